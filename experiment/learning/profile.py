"""A rank's numerical profile: everything that decides its arithmetic (docs/protocol.md, "Numerical profile").

Two parts, with different rules:
- **shared**: the libraries' versions, the device kind, threads, autocast, deterministic mode, cuBLAS's workspace
  and TF32. They decide which kernels a rank runs and how, so every rank of a gang must hold the same ones: they
  enter the run's binding, and a rank whose shared field differs from its peers' is refused before its first
  update, naming the field (``check_shared``).
- **machine**: the CPU's vendor, model and instruction sets, torch's CPU capability, the BLAS and oneDNN builds and
  their reproducibility settings; on a GPU its model, compute capability, driver, CUDA runtime, cuBLAS and cuDNN.
  They decide the last bits of a rank's results, never whether they are valid: a DDP pair on two CPU models sums
  two correctly computed gradients. So they are recorded, per rank, and say which class of machine a digest
  holds for (``coop rerun`` names the ones that differ), but no rank is refused for them.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

import msgspec
import numpy
import safetensors
import tokenizers
import torch
import torch.distributed as dist

from experiment.core import determinism
from experiment.core.canonical import canonical_bytes
from experiment.core.errors import CoopError
from experiment.core.plan import Plan
from experiment.learning.distributed import World
from experiment.learning.records import NumericalProfile

# The instruction sets whose presence changes which kernels MKL, oneDNN or ATen choose.
CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
# The variables by which MKL and oneDNN trade speed for reproducibility or cap their instruction set.
SETTINGS = (
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "ONEDNN_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "ATEN_CPU_CAPABILITY",
)
MACHINE = (
    "cpu_vendor",
    "cpu_model",
    "cpu_flags",
    "cpu_capability",
    "blas",
    "mkl",
    "onednn",
    "settings",
    "gpu_capability",
    "gpu_driver",
    "cuda_runtime",
    "cublas",
    "cudnn",
)


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return fields
    for line in text.split("\n\n", 1)[0].splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def _built(pattern: str) -> str | None:
    found = re.search(pattern, torch.__config__.show())
    return found.group(1).strip() if found else None


def _package(*names: str) -> str | None:
    for name in names:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def machine(device: torch.device) -> NumericalProfile:
    """The machine part: what this host's hardware and its math libraries' builds and settings are."""
    cpu = _cpuinfo()
    flags = set(cpu.get("flags", "").split())
    settings = " ".join(f"{name}={os.environ[name]}" for name in SETTINGS if name in os.environ)
    found: NumericalProfile = {
        "cpu_vendor": cpu.get("vendor_id"),
        "cpu_model": cpu.get("model name"),
        "cpu_flags": " ".join(flag for flag in CPU_FLAGS if flag in flags),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "blas": _built(r"BLAS_INFO=([^,]+)"),
        "mkl": _built(r"Math Kernel Library Version ([^\n]+?) for"),
        "onednn": _built(r"MKL-DNN (v[^\s]+)"),
        "settings": settings or None,
    }
    if device.type != "cuda":
        return found | dict.fromkeys(("gpu_capability", "gpu_driver", "cuda_runtime", "cublas", "cudnn"))
    major, minor = torch.cuda.get_device_capability(device)
    driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # torch's own, not public: absent, it is None
    cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    gpu: NumericalProfile = {
        "gpu_capability": f"{major}.{minor}",
        "gpu_driver": None if driver is None else str(driver()),
        "cuda_runtime": torch.version.cuda,
        "cublas": _package("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12"),
        "cudnn": None if cudnn is None else str(cudnn),
    }
    return found | gpu


def numerical_profile(plan: Plan, device: torch.device) -> NumericalProfile:
    """The whole profile: the shared part, then the machine part."""
    shared_part: NumericalProfile = {
        "torch": str(torch.__version__),
        "transformers": importlib.metadata.version("transformers"),  # the prepared tokens' tokenizer, unimported
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": numpy.__version__,
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "autocast": plan.runtime.autocast,
        **determinism.profile(device.type),
        "tf32": device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32,
    }
    return shared_part | machine(device)


def shared(profile: NumericalProfile) -> NumericalProfile:
    """The fields every rank of a gang must share (the binding's)."""
    return {name: value for name, value in profile.items() if name not in MACHINE}


def differing(first: NumericalProfile, second: NumericalProfile) -> list[str]:
    """The fields whose values differ, or that one of the two lacks, in name order."""
    return sorted(name for name in first.keys() | second.keys() if first.get(name) != second.get(name))


def _gathered(world: World, data: bytes, device: torch.device) -> list[bytes]:
    """Every rank's ``data``, in rank order: lengths, then the bytes padded to the longest (uint8 tensors, no
    pickle, as every exchange between ranks)."""
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world.size)]
    dist.all_gather(lengths, length)
    width = max(int(n.item()) for n in lengths)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    found = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(found, mine)
    return [bytes(t[: int(n.item())].cpu().tolist()) for t, n in zip(found, lengths, strict=True)]


def check_shared(world: World, profile: NumericalProfile, device: torch.device) -> None:
    """Refuse, on every rank, a gang whose ranks' shared fields differ, naming each field with every rank's value."""
    if not world.distributed:
        return
    mine = shared(profile)
    peers = [
        msgspec.json.decode(data, type=NumericalProfile) for data in _gathered(world, canonical_bytes(mine), device)
    ]
    fields = sorted({name for peer in peers for name in differing(mine, peer)})
    if fields:
        values = "; ".join(f"{name}: {[peer.get(name) for peer in peers]}" for name in fields)
        raise CoopError(f"the gang's ranks differ in their numerical profile's shared fields ({values})")
