"""What the engine hands back: one `SampleOutput` per finished (prompt, sample).

The server turns a list of these into one Arrow record batch (rollout.schema). Masks stay flat
numpy arrays (`rollout.masks.pack.Supports`) from the step's host copy to the Arrow columns;
`support_ids` / `support_logprobs` give them as per-token lists for whoever wants lists (built
on each read: assign new lists to change them, mutating a returned list changes nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollout.masks.pack import Supports


@dataclass
class SampleOutput:
    """One finished sample, aligned per committed token (docs/masks.md).

    `supports` is None unless the request asked for masks; its log-probs are None unless mask
    mode is "support". `error` is set (and the token lists are empty) when the sample failed as
    a whole, e.g. a support overflow; `finish_reason` is then "error".
    """

    request_id: str
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    supports: Supports | None = None
    finish_reason: str = "length"
    accept_lengths: list[int] = field(default_factory=list)
    policy_version: int = 0
    error: str | None = None

    @property
    def support_ids(self) -> list[list[int]] | None:
        """Per committed token, its support's token ids (None without masks)."""
        return None if self.supports is None else self.supports.id_lists()

    @support_ids.setter
    def support_ids(self, ids: list[list[int]] | None) -> None:
        self.supports = None if ids is None else Supports.from_lists(ids)

    @property
    def support_logprobs(self) -> list[list[float]] | None:
        """Per committed token, its support's log-probs (None unless mask mode "support")."""
        return None if self.supports is None else self.supports.logprob_lists()

    @support_logprobs.setter
    def support_logprobs(self, logprobs: list[list[float]] | None) -> None:
        if self.supports is None:
            if logprobs is not None:
                raise ValueError("set support_ids before support_logprobs")
            return
        self.supports = Supports.from_lists(self.supports.id_lists(), logprobs)
