"""The outlier metrics of a two-families run side by side, per model: the rotation papers' kurtosis (each
channel's RMS over tokens, then the Pearson kurtosis over channels: QuaRot / SpinQuant) of the Linear inputs
that W8A8 quantizes, the Pearson kurtosis of all values, the largest |x|, and where the massive activations
(Sun et al. 2024) sit.

    python analysis/families/kurtosis.py runs/two-families
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from diffquant.profile.profiler import Profile

GROUPS = {  # the Linear inputs of one block, by what they read
    "attn in (q/k/v)": ("attn.q_proj.input",),
    "attn out (o_proj)": ("attn.o_proj.input",),
    "MLP in (gate/up)": ("mlp.gate.input",),
    "MLP down": ("mlp.down.input",),
    "hidden states": ("resid",),
}


def main(run: Path) -> None:
    print(
        f"{'model':<9} {'activation':<18} {'rms-kurtosis median':>19} {'max (layer)':>16} {'kurtosis median':>15}"
    )
    for path in sorted((run / "profile").glob("*.json")):
        profile = Profile.load(path)
        summaries = {name: s.summary() for name, s in profile.sites.items()}
        for group, suffixes in GROUPS.items():
            rows = [(n, s) for n, s in summaries.items() if n.endswith(suffixes)]
            rms = [(s["channel_rms_kurtosis"], int(n.split(".")[1])) for n, s in rows]
            top = max(rms)
            whole = statistics.median(s["kurtosis"] for _, s in rows)
            print(
                f"{path.stem:<9} {group:<18} {statistics.median(k for k, _ in rms):>19.1f} "
                f"{top[0]:>10.1f} ({top[1]:>2}) {whole:>15.1f}"
            )
        massive = [(n, s) for n, s in profile.sites.items() if n.endswith("resid")]
        first = next((n for n, s in massive if s.summary().get("massive_count")), None)
        print(f"{path.stem:<9} first layer output with a massive activation: {first}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/two-families"))
