"""Count a profile's host syncs, the waits for the device (issue 45): as CUDA itself reports them on a GPU
(``torch.cuda.set_sync_debug_mode("warn")``, which also sees syncs inside torch's own CUDA ops), or on a CPU
as the fake-CUDA stand-in of the device check counts them (tests/devicecheck.py).

    python analysis/profile/device_syncs.py [--device cuda] [--kinds diff_v1 diff_v2] [--out FILE]

Per kind: a random model of preset tiny (``init:KIND:tiny``), 4 windows of 24 byte ids in batches of 2, top 5,
all attention metrics, profiled once to warm up (the histogram's fold table is copied to the device once, the
model keeps its mask), then again with every sync recorded: the count and the lines that made them, most
frequent first. What to expect: one sync per site update (the update's one transfer) and one per batch
(its token ids), the stand-in's count on a CPU (``--device cpu``); more on the GPU would be syncs the
stand-in cannot see.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _profile(model, ids) -> None:
    from diffquant.profile import profile_model

    profile_model(model, ids, batch_size=2, topk=5, attention=True)


def _where(frames) -> str:
    """file:line of the innermost frame in diffquant, else of the innermost frame."""
    ours = [f for f in frames if "/diffquant/" in f.filename.replace("\\", "/")]
    frame = (ours or frames)[-1]
    return f"{Path(frame.filename).name}:{frame.lineno}"


def _cuda_syncs(model, ids) -> list[str]:
    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _profile(model, ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught]


def _stand_in_syncs(model, ids) -> list[str]:
    """The same profile with the model on the device check's stand-in CUDA, each recorded sync located."""
    sys.path.insert(0, str(ROOT / "tests"))
    import devicecheck

    located: list[str] = []
    record = devicecheck._sync

    def locate(what: str) -> None:
        if devicecheck._syncs is not None:
            located.append(_where(traceback.extract_stack()[:-2]))
        record(what)

    devicecheck._sync = locate
    try:
        with devicecheck.fake_cuda():
            model.to("cuda")
            x = ids.to("cuda")
            _profile(model, x)  # warm-up
            with devicecheck.host_syncs():
                _profile(model, x)
            model.to("cpu")
    finally:
        devicecheck._sync = record
    return located


def run(device_name: str, kinds: list[str]) -> dict:
    import torch

    from diffquant.io.load import init_model

    rows = []
    for kind in kinds:
        model = init_model(f"init:{kind}:tiny")
        ids = torch.randint(3, model.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(0))
        if device_name == "cpu":
            how, syncs = "stand-in", _stand_in_syncs(model, ids)
        else:
            model.to(device_name)
            ids = ids.to(device_name)
            _profile(model, ids)  # warm-up
            how, syncs = "cuda", _cuda_syncs(model, ids)
        lines = collections.Counter(syncs).most_common(10)
        rows.append({"kind": kind, "counted_by": how, "syncs": len(syncs), "batches": 2, "lines": lines})
        print(
            f"{kind:<9} {how:<9} {len(syncs):>6}  " + ", ".join(f"{n} x {w}" for w, n in lines[:4]),
            flush=True,
        )
    return {"device": device_name, "windows": [4, 24], "batch_size": 2, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (CUDA's own count) or cpu (the stand-in's)")
    parser.add_argument("--kinds", nargs="+", default=["diff_v1", "diff_v2"])
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    print(f"{'kind':<9} {'counted':<9} {'syncs':>6}  most frequent lines")
    result = run(args.device, args.kinds)
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
