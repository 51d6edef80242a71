"""The characters-per-token ratio of the fleet's tokenizer, learned from the nodes' usage reports.

The gateway estimates a prompt's tokens from its rendered characters (``routing.cache.prompt``); the
policy's ``chars_per_token`` is only a starting point (4.0, the usual English average). Real
ratios vary by tokenizer, language and content (code, CJK text, the chat template's own tokens),
and the cost model's prefill and queue terms scale with the estimate: a 20 % overestimate of
tokens inflates every queue by 20 % against the fixed network term, and tips local-versus-remote
decisions the wrong way.

Every answer carries ``usage.prompt_tokens``, the node's exact count, so each finished request is
one (characters, tokens) observation. ``CharsPerToken`` keeps exponentially decayed sums of both
(so long prompts, whose prefill matters most, weigh most) and offers their ratio once enough
requests were seen. The value in use changes only when the learned ratio moved past a small
band, because a change also resizes the prefix index (its chunks' token counts).

One ratio per gateway: a fleet serving models with very different tokenizers would want one per
model (the index's chunk sizes would then have to follow per node).
"""

from __future__ import annotations

from typing import Final

# Weight of one request's observation; about the last 50 requests count.
DECAY: Final = 0.02
# Requests observed before the learned ratio replaces the policy's.
MIN_OBSERVATIONS: Final = 20
# The value in use follows the learned ratio only once they differ by more than this.
CHANGE_BAND: Final = 0.03
# The bounds GorgoParams.chars_per_token accepts.
MIN_RATIO: Final = 0.5
MAX_RATIO: Final = 20.0


class CharsPerToken:
    """Prompt characters per node token: the policy's prior until the nodes' counts say otherwise."""

    __slots__ = ("_chars", "_observations", "_prior", "_tokens", "value")

    def __init__(self, prior: float) -> None:
        self._reset(prior)

    def _reset(self, prior: float) -> None:
        self._prior = prior
        self.value = prior  # what the gateway estimates with now; read on the request path
        self._chars = 0.0
        self._tokens = 0.0
        self._observations = 0

    @property
    def learned(self) -> float | None:
        """The ratio the observations say, or ``None`` before ``MIN_OBSERVATIONS``."""
        if self._observations < MIN_OBSERVATIONS or self._tokens <= 0:
            return None
        return min(MAX_RATIO, max(MIN_RATIO, self._chars / self._tokens))

    def set_prior(self, prior: float) -> bool:
        """A snapshot's ``chars_per_token``: a new one restarts learning from it. ``True`` if the
        value in use changed."""
        if prior == self._prior:
            return False
        changed = prior != self.value
        self._reset(prior)
        return changed

    def observe(self, prompt_chars: int, prompt_tokens: int) -> bool:
        """One finished request; ``True`` when the value in use changed (resize the index)."""
        if prompt_chars <= 0 or prompt_tokens <= 0:
            return False
        keep = 1.0 - DECAY
        self._chars = self._chars * keep + prompt_chars
        self._tokens = self._tokens * keep + prompt_tokens
        self._observations += 1
        learned = self.learned
        if learned is None or abs(learned / self.value - 1.0) <= CHANGE_BAND:
            return False
        self.value = learned
        return True
