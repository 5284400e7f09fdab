"""When a row stops, and the text it returns."""

from __future__ import annotations

from batchllm.engine.request import Sequence


class StopChecker:
    """Decides after each new token whether a row is finished: end of sequence, a stop string
    (found in the decoded text, so also across token boundaries; the stop string and what
    follows are not returned), max_tokens, or the model's length limit."""

    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def check(self, seq: Sequence) -> bool:
        """Sets seq.finish_reason (and seq.text for a stop string); True when finished.

        A constrained row also stops when its grammar is complete (even with ignore_eos: only
        end-of-sequence could follow), which wins over max_tokens reached by the same token."""
        sp = seq.sampling
        out = seq.output_ids
        if not sp.ignore_eos and out[-1] in self.eos_ids:
            seq.finish_reason = "stop"
            return True
        if seq.matcher is not None and seq.matcher.is_stopped():
            seq.finish_reason = "stop"
            return True
        if sp.stop:
            text = self.decode(out)
            hits = [i for i in (text.find(s) for s in sp.stop) if i >= 0]
            if hits:
                seq.text = text[: min(hits)]
                seq.finish_reason = "stop"
                return True
        if len(out) >= sp.max_tokens or seq.total >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def final_text(self, seq: Sequence) -> str:
        return seq.text if seq.text is not None else self.decode(seq.output_ids)
