"""Train the small byte-level Qwen2 model in tests/fixtures/byte-lm (deterministic).

    python scripts/train_byte_lm.py [--steps 800] [-o tests/fixtures/byte-lm]

Why: on random weights a model's logits are nearly flat, so bf16 rounding alone decides
many argmaxes (transformers' own bf16 and fp32 runs agree on about 97-98% of positions
there). A model that has learnt something makes real decisions, as a served model does,
so top-1 agreement between two bf16 implementations measures the implementations.

The model (4 layers, hidden 128, GQA 4/2 heads, tied embeddings, 256-byte vocabulary) is
trained with transformers on the bytes of schedkit's own Python sources (single thread,
seed 0); tests evaluate it on held-out text (docs/*.md). Saved in bfloat16.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from schedkit.runners.paged.builder import tiny_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = tiny_config("qwen2", vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=4,
                     num_heads=4, num_kv_heads=2, tie_word_embeddings=True, max_position_embeddings=1024)


def corpus() -> torch.Tensor:
    files = sorted((REPO / "schedkit").rglob("*.py"))
    return torch.tensor(list(b"".join(p.read_bytes() for p in files)), dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("-o", "--output", default=str(REPO / "tests" / "fixtures" / "byte-lm"))
    a = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = corpus()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CONFIG), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    length, batch = 256, 16
    t0 = time.perf_counter()
    for step in range(a.steps):
        for group in opt.param_groups:
            group["lr"] = 3e-3 * (1 - step / a.steps)
        starts = torch.randint(0, len(data) - length, (batch,), generator=g)
        x = torch.stack([data[s:s + length] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} nats/byte  {time.perf_counter() - t0:.0f}s", flush=True)
    model.to(torch.bfloat16).save_pretrained(a.output)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
