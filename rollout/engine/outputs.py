"""What the engine hands back: one `SampleOutput` per finished (prompt, sample).

Pure Python; the server turns a list of these into one Arrow record batch (rollout.schema).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampleOutput:
    """One finished sample, aligned per committed token (DESIGN.md Contract 3).

    `support_ids` is None unless the request asked for masks; `support_logprobs` is None
    unless mask mode is "support". `error` is set (and the token lists are empty) when the
    sample failed as a whole, e.g. a support overflow; `finish_reason` is then "error".
    """

    request_id: str
    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    support_ids: list[list[int]] | None = None
    support_logprobs: list[list[float]] | None = None
    finish_reason: str = "length"
    accept_lengths: list[int] = field(default_factory=list)
    policy_version: int = 0
    error: str | None = None
