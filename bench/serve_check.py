"""The server as a user calls it, on a device: `loraplex serve --device DEVICE` on a model with two
adapters, asked by the official `openai` client for the base model and each adapter, streamed and not,
completions and chat. Exits non-zero (naming what failed) unless every answer has the tokens asked for and
the adapters change the greedy output. `make gpu-check` runs it with --device cuda; the suite runs it on CPU.
Usage: python -m bench.serve_check [--device cuda] [--model DIR] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from bench.adapters import write_peft_adapter
from bench.serving import start_server, stop_server


def check(url: str, model: str, adapters: list[str], tokens: int = 8) -> list[str]:
    """-> what failed (empty: all well)."""
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    failed, greedy = [], {}
    listed = {m.id for m in client.models.list().data}
    if not {model, *adapters} <= listed:
        failed.append(f"/v1/models lists {sorted(listed)}, not {[model, *adapters]}")
    for name in (model, *adapters):
        extra = {"ignore_eos": True}
        out = client.completions.create(model=name, prompt="The capital of France is", max_tokens=tokens,
                                        temperature=0, extra_body=extra)
        greedy[name] = out.choices[0].text
        if out.usage.completion_tokens != tokens:
            failed.append(f"{name}: completion gave {out.usage.completion_tokens} tokens, not {tokens}")
        chunks = list(client.completions.create(model=name, prompt="The capital of France is", max_tokens=tokens,
                                                temperature=0, stream=True, extra_body=extra))
        if "".join(c.choices[0].text for c in chunks if c.choices) != greedy[name]:
            failed.append(f"{name}: the streamed completion differs from the plain one")
        chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hello."}],
                                              max_tokens=tokens, temperature=0, extra_body=extra)
        if chat.usage.completion_tokens != tokens or not chat.choices[0].message.content:
            failed.append(f"{name}: chat gave {chat.usage.completion_tokens} tokens")
        stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Say hello."}],
                                                max_tokens=tokens, temperature=0, stream=True, extra_body=extra)
        if "".join(c.choices[0].delta.content or "" for c in stream if c.choices) != chat.choices[0].message.content:
            failed.append(f"{name}: the streamed chat differs from the plain one")
    if all(greedy[a] == greedy[model] for a in adapters):
        failed.append("the adapters do not change the greedy output")
    for name, text in greedy.items():
        print(f"  {name:>24}: {text!r}")
    return failed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    import torch

    from engine.config import EngineConfig
    cfg = EngineConfig.create(model=args.model, dtype=args.dtype).model
    work = Path(tempfile.mkdtemp(prefix="loraplex-serve-check-"))
    names = ["check-r8", "check-r16"]
    for i, (name, rank) in enumerate(zip(names, (8, 16))):
        write_peft_adapter(work / name, cfg, rank, ("q_proj", "v_proj", "down_proj"), seed=i, dtype=torch.float32,
                           std=0.2)
    proc, url = start_server(["--device", args.device, "--model", args.model, "--dtype", args.dtype,
                              "--adapter-dir", str(work), "--frontends", "1"])
    try:
        failed = check(url, cfg.name, names)
    finally:
        stop_server(proc)
        shutil.rmtree(work, ignore_errors=True)
    for f in failed:
        print("FAILED:", f)
    print(f"serve_check on {args.device}: {'ok' if not failed else f'{len(failed)} failed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
