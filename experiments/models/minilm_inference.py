"""Does a compressed all-MiniLM-L6-v2 serve faster? CPU inference time of the encoder compressed
to 50% of its linear layers' parameters by ``tnspec.compress`` (the default, and with
``latency=True``, which drops candidates slower than the dense layer), against the original,
in one process on the same inputs.

Inputs: Rotten Tomatoes snippets tokenized to exactly 128 tokens (padded or cut), batch 1 and
batch 32; ``torch.no_grad``, eval mode. Each model's first call plans its layers (untimed);
then interleaved rounds (every model once per round), medians; the ratio is to the original
in the same rounds. ``compress`` sees 4 held-out batches of 32 snippets.

    python -m experiments.models.minilm_inference            # 5-13 minutes on 2 cores
    python -m experiments.models.minilm_inference --smoke    # the tests run it (seconds)
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import tnspec

from .. import assets
from ..common import formats_chosen, inference_rows, markdown_table, save
from .minilm_compress import encoder_params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny version (seconds)")
    args = parser.parse_args(argv)
    prefix = "encoder.layer.5." if args.smoke else "encoder."
    started = time.time()
    torch.manual_seed(0)
    model, tokenizer = assets.minilm()
    model.eval()
    texts, _ = assets.rotten_tomatoes()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()

    def tokens(idx: list[int], length: int) -> dict:
        return dict(tokenizer([texts[i] for i in idx], padding="max_length", truncation=True,
                              max_length=length, return_tensors="pt"))
    n_fit = 32 if args.smoke else 128
    fit = [tokens(order[i:i + 32], 64) for i in range(0, n_fit, 32)]
    length = 16 if args.smoke else 128
    batches = {"batch 1": tokens(order[n_fit:n_fit + 1], length),
               "batch 32": tokens(order[n_fit + 1:n_fit + 33], length)}
    options = {"formats": ("low_rank", "tt"), "shares": (0.25, 0.5)} if args.smoke else {}
    models, notes = {"original": model}, []
    for label, latency in (("compress 50%", False), ("compress 50%, latency=True", True)):
        t = time.time()
        made, report = tnspec.compress(copy.deepcopy(model), 0.5, data=fit,
                                       include=prefix + "*", latency=latency, **options)
        made.eval()
        models[label] = made
        notes.append(f"{label}: {encoder_params(made, prefix):,} of "
                     f"{encoder_params(model, prefix):,} encoder parameters, compressed in "
                     f"{time.time() - t:.0f} s; formats chosen: "
                     + formats_chosen(report))
        print(notes[-1], flush=True)
    rows = inference_rows(models, batches, 3 if args.smoke else 25,
                          lambda m, b: m(**b))
    return _write(rows, notes, started, args.smoke, length)


def _write(rows: list[tuple], notes: list[str], started: float, smoke: bool,
           length: int) -> int:
    text = ("# all-MiniLM-L6-v2 compressed to 50%: CPU inference time\n\n"
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {length} tokens, "
            "no_grad, eval; medians of interleaved rounds after a first call per model.\n\n"
            + markdown_table(["model", "input", "ms per forward", "x original"], rows)
            + "\n\n" + "\n".join(f"- {line}" for line in notes))
    print(text)
    if not smoke:
        print(f"wrote {save('minilm_inference', text, started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
