"""Probe passes: tokens run after the prompt before compressing (KVzip's reconstruction of the
context), observed like any pass, then taken out of every layer."""

from __future__ import annotations

from dataclasses import replace

import torch

from d2o.engine.api import ProbePass


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, S) padded on the left with 0 (masked everywhere), and the mask (1: real)."""
    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.as_tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


class Prober:
    """A cache's probe passes: the prompt's ids recorded as it is fed, then the policy's passes."""

    def __init__(self):
        self.probing: ProbePass | None = None  # the probe pass running now
        self.probed = False  # the policy's probe passes ran
        self._prompt: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids, real) of each pass before them

    def copy(self) -> Prober:
        new = Prober()
        new.probed, new._prompt = self.probed, list(self._prompt)
        return new

    def record(self, input_ids: torch.Tensor, real: torch.Tensor) -> None:
        """Keep a pass's token ids (B, q) and which are real, until the probe has read them."""
        self._prompt.append((input_ids.to(real.device), real))

    def forget(self) -> None:
        self._prompt = []

    def prompts(self) -> list[list[int]]:
        """Each row's prompt token ids as recorded (padding left out)."""
        ids = torch.cat([ids for ids, _ in self._prompt], dim=1)
        real = torch.cat([real for _, real in self._prompt], dim=1)
        return [row[mask].tolist() for row, mask in zip(ids, real)]

    def policy_passes(self, cache) -> list[ProbePass]:
        """The policy's passes for the prompt recorded since the last ones (a chunk's, in a prefill in
        chunks), their spans shifted to the tokens' indices in the whole prompt."""
        prompts = self.prompts()
        offsets = [int(seen) - len(prompt) for seen, prompt in zip(cache.layers[0].real_seen.tolist(), prompts)]
        self.probed = True
        self.forget()
        return [probe if probe.spans is None else replace(probe, spans=[
            (start + offset, end + offset) for (start, end), offset in zip(probe.spans, offsets)])
            for probe in cache.policy.probe(cache.view, prompts)]

    def run(self, cache, passes: list[ProbePass]) -> None:
        """Feed each pass after the prompt (or at its ``positions``), observed, then taken out."""
        decoder = cache.facts.decoder()
        first = cache.layers[0]
        snapshots = [layer.snapshot() for layer in cache.layers]
        try:
            for probe in passes:
                if not any(probe.ids):
                    continue
                ids, real = (tensor.to(first.device) for tensor in left_pad(probe.ids))
                starts = first.real_seen if probe.positions is None else \
                    torch.tensor(probe.positions, device=first.device)
                positions = starts[:, None] + real.cumsum(-1) - 1
                mask = None
                if not bool(real.all()):
                    mask = torch.cat([real.new_ones((len(probe.ids), first.seen)), real], dim=1)
                self.probing = probe
                decoder(input_ids=ids, attention_mask=mask, position_ids=positions.clamp_min(0), cache=cache,
                        use_cache=True)
                for layer, snapshot in zip(cache.layers, snapshots):
                    layer.restore(snapshot)
        finally:
            self.probing = None
