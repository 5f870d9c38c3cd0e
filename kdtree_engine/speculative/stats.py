"""Per-request round statistics and stage timers, shared by the host-driven and device-resident rounds."""

from __future__ import annotations

import time
from typing import Any

import torch

STAGES = ("draft_s", "tree_s", "verify_s", "commit_s")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Stage timers that synchronize the device around each stage (``synced`` False: host time only, for rounds
    that share a forward with other requests, where a stage of one request is not a unit of device work)."""

    def __init__(self, device: torch.device, synced: bool = True) -> None:
        self.device = device if synced else torch.device("cpu")
        self.totals: dict[str, float] = {k: 0.0 for k in STAGES}
        self._t = 0.0

    def start(self) -> None:
        sync(self.device)
        self._t = time.perf_counter()

    def lap(self, key: str) -> None:
        sync(self.device)
        now = time.perf_counter()
        self.totals[key] += now - self._t
        self._t = now


class RoundStats:
    """What the rounds of one request accepted: tau, drafts proposed, accepted drafts per depth."""

    def __init__(self, block_size: int) -> None:
        self.rounds = 0
        self.accepted_lens: list[int] = []
        self.per_depth = [0] * max(block_size - 1, 0)
        self.draft_tokens = 0

    def record(self, accepted: int, drafted: int) -> None:
        """One round: ``accepted`` tokens emitted (accepted drafts + the bonus), ``drafted`` non-root nodes."""
        self.rounds += 1
        self.accepted_lens.append(accepted)
        self.draft_tokens += drafted
        for d in range(accepted - 1):
            self.per_depth[d] += 1

    def summary(self, generated: int, prefill_s: float, decode_s: float) -> dict[str, Any]:
        lens = self.accepted_lens
        return dict(
            generated_tokens=generated, prefill_s=prefill_s, decode_s=decode_s,
            tokens_per_s=(generated - 1) / decode_s if generated > 1 and decode_s > 0 else 0.0,
            rounds=self.rounds,
            tau=sum(lens) / len(lens) if lens else 0.0,
            draft_tokens=self.draft_tokens,
            accepted_tokens=sum(a - 1 for a in lens),
            accepted_per_depth=self.per_depth,
        )
