"""The reference's way of serving, as a baseline: Hugging Face generate, one request at a time behind a lock.

POST /infer {"request_id", "task_id"} answers a prepared dev task with exactly --tokens new tokens (EOS
suppressed, so every request does the same work as a vLLM request with ignore_eos). GET /health answers 200.

Usage: python bench/reference_replica.py --home HOME --model-dir seeds/tiny --port P [--tokens 96]"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import msgspec
import torch
import uvicorn
from litestar import Litestar, get, post
from litestar.exceptions import HTTPException

from experiment.learning.corpus import load_prepared
from experiment.seed import seedmodel
from experiment.serving.probe import InferRequest


class Reply(msgspec.Struct, frozen=True):
    request_id: str
    task_id: str
    output_ids: list[int]


def create_app(home: Path, model_dir: Path, tokens: int) -> Litestar:
    prompts = {item.id: item.prompt_ids for item in load_prepared(home).task_items("dev")}
    tokenizer = seedmodel.load_tokenizer(model_dir)
    from transformers import LlamaForCausalLM  # the reference replica is transformers' generate, not coop's model

    model = LlamaForCausalLM.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32).eval()
    pad = int(tokenizer.pad_token_id)
    lock = asyncio.Lock()

    @torch.no_grad()
    def generate(prompt: list[int]) -> list[int]:
        generate_fn: Any = getattr(model, "generate")  # noqa: B009 (a transformers model)
        out = generate_fn(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,  # EOS suppressed until the fixed length
            pad_token_id=pad,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        return [int(t) for t in out[0, len(prompt) :].tolist()]

    @post("/infer", status_code=200)
    async def infer(data: InferRequest) -> Reply:
        prompt = prompts.get(data.task_id)
        if prompt is None:
            raise HTTPException(status_code=404, detail=f"task {data.task_id} is not a prepared dev task")
        async with lock:  # one request at a time, as the reference replica
            output = await asyncio.to_thread(generate, prompt)
        return Reply(request_id=data.request_id, task_id=data.task_id, output_ids=output)

    @get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return Litestar(route_handlers=[infer, health], openapi_config=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    torch.set_num_threads(1)
    uvicorn.run(
        create_app(args.home, args.model_dir, args.tokens), host="127.0.0.1", port=args.port, log_level="warning"
    )


if __name__ == "__main__":
    main()
