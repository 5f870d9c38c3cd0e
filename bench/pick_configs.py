"""The best kernel config per shape from a `bench/moe_formats.py --sweep` record, printed as the table entries of
kernels/w8a16.py (W8_CONFIGS) and, per expert shape, the grouped MoE's config (kernels/moe_grouped.py GROUPED_CONFIG:
one for every shape while the sweep finds the same best).

    python bench/pick_configs.py bench/results/moe_formats_sweep-h200.json

Best = the least time summed over the swept M (dense) or T (MoE): one config serves every M / T (batch invariance).
Each pick is printed with its times and those of the default config, so a pick that does not beat it is visible.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def best(rows: list[dict], group: tuple[str, ...], over: str) -> dict[tuple, tuple[str, dict[int, float]]]:
    """{group key: (config repr, {M or T: us})} of the config with the least summed time in each group."""
    table: dict[tuple, dict[str, dict[int, float]]] = {}
    for r in rows:
        table.setdefault(tuple(r[g] for g in group), {}).setdefault(r["config"], {})[r[over]] = r["us"]
    return {key: min(cfgs.items(), key=lambda kv: sum(kv[1].values())) for key, cfgs in table.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("record", type=Path, help="moe_formats_sweep-<device>.json")
    a = ap.parse_args(argv)
    try:
        rep = json.loads(a.record.read_text())
    except (OSError, ValueError) as exc:
        sys.exit(f"pick_configs: cannot read {a.record}: {exc}")
    if "sweep_dense" not in rep or "sweep_moe" not in rep:
        sys.exit(f"pick_configs: {a.record} holds no sweep (run bench/moe_formats.py --sweep)")
    dense_default = {(r["N"], r["K"], r["M"]): r["w8a16_us"] for r in rep.get("dense", [])}
    print("# W8_CONFIGS")
    for (name, n, k), (cfg, us) in best(rep["sweep_dense"], ("linear", "N", "K"), "M").items():
        f_lin = {r["M"]: r["f_linear_us"] for r in rep["sweep_dense"] if r["linear"] == name}
        times = ", ".join(f"M={m}: {t:.1f} us (default {dense_default.get((n, k, m), float('nan')):.1f}, "
                          f"F.linear {f_lin[m]:.1f})" for m, t in sorted(us.items()))
        print(f"    ({n}, {k}): {cfg},   # {name}: {times}")
    print("# grouped MoE (GROUPED_CONFIG)")
    for (label,), (cfg, us) in best(rep["sweep_moe"], ("experts",), "T").items():
        times = ", ".join(f"T={t}: {v:.1f} us" for t, v in sorted(us.items()))
        print(f"    {label}: {cfg},   # {times}")


if __name__ == "__main__":
    main()
