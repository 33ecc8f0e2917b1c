"""The size-vs-quality picture of the weight-only part: perplexity rise and KL to FP32
against bits per weight, one point per tool, for one decoder, from one or more results
files of `bench/run.sh --weights-only` (rows of the same model measured on the same
held-out windows; a tool in several files keeps its last row).

    python -m bench.weights.plot MODEL OUT.png RESULTS.json [RESULTS.json ...]

Bits per weight: 32 x the file's size against the FP32 file's (a GGUF file's tokenizer
and an ONNX file's graph included). mixprec's points are joined in order of size (its
`--max-size` rows and its default); the peers are single points.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def rows(model: str, files: list[Path]) -> dict[str, dict[str, Any]]:
    """The measured rows of ``model`` by tool, later files overriding earlier ones."""
    found: dict[str, dict[str, Any]] = {}
    for path in files:
        part = json.loads(path.read_text())["weights"].get(model)
        for row in (part or {}).get("rows", []):
            if row.get("tool") != "fp32" and row.get("perplexity_change") is not None:
                found[row["tool"]] = row
    return found


def plot(model: str, found: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    mixprec = sorted((r for t, r in found.items() if t.startswith("mixprec-int4")),
                     key=lambda r: r["size_ratio"])
    for ax, key, label in ((axes[0], "perplexity_change", "perplexity rise vs FP32 (%)"),
                           (axes[1], "kl", "KL(FP32 || model), nats per token")):
        scale = 100.0 if key == "perplexity_change" else 1.0
        if mixprec:
            ax.plot([32 * r["size_ratio"] for r in mixprec],
                    [scale * r[key] for r in mixprec], "o-", color="tab:blue", label="mixprec")
        for tool, r in found.items():
            x, y = 32 * r["size_ratio"], scale * r[key]
            mine = tool.startswith("mixprec")
            if not mine:
                ax.plot([x], [y], "s", color="tab:orange" if "llamacpp" in tool else "tab:gray")
            ax.annotate(tool.replace("mixprec-int4-", "").replace("mixprec-", ""), (x, y),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("bits per weight (32 x size / FP32 size)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="center right", fontsize=8)
    fig.suptitle(f"{model}: weight-only quantizers, held-out windows (lower is better)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__)
        return 2
    model, out, files = argv[0], Path(argv[1]), [Path(p) for p in argv[2:]]
    found = rows(model, files)
    if not found:
        print(f"plot_weights: no measured rows of {model} in {', '.join(map(str, files))}")
        return 1
    plot(model, found, out)
    print(f"plot_weights: {len(found)} tools of {model} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
