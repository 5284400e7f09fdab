"""When a row stops, and the text it returns.

Stop strings are matched on the newly decoded text only. Each row with stop strings keeps an
incremental decoder (vLLM's detokenize_incrementally): the tokens from `prefix` on are decoded
each step, and the text past that of the tokens from `prefix` to `read` is the new text; then
`prefix` moves to `read` and `read` to the end. New text that ends inside a character (byte-level
tokens; it then ends in U+FFFD) is searched but decoded again with the next token, up to
_MAX_WAIT tokens. A stop string found this step must end in the new text, so it lies within the
new text and the longest stop string's length minus one characters before it: that is all a
step searches, whatever the output's length (config.limits caps stop strings at MAX_STOP of
MAX_STOP_CHARS characters). The text so far is the emitted pieces, joined once, at a stop.

A stop string can only end in a token whose text holds its last character, so a row whose new
token cannot end one is not decoded that step (most steps of most rows): its token joins the next
decode, up to _MAX_SKIP tokens later. A token's own text (decoded alone, once per token id) tells:
decoded in context it gains at most a leading space (SentencePiece's Metaspace, WordPiece), and a
token that splits a character decodes alone to U+FFFD or nothing, so those are always decoded, and
a row with a stop string that ends in a space is decoded every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchllm.engine.request import Request
from batchllm.engine.row_slots import RowSlots

_MAX_WAIT = 16  # tokens decoded again while the text ends inside a character, at most
_BATCH_DECODE_FROM = 32  # sequences; fewer are decoded one by one (where batches are used)
_MAX_SKIP = 64  # tokens that cannot end a stop string left undecoded in a row, at most (a
# check then decodes ~130 tokens at most; at 8, rows with stop strings were decoded every 9th
# token: 0.15-0.2 ms a step at 256 rows of bench_step_overhead's mix)
_MAX_SETS = 256  # distinct sets of stop strings' last characters skip_many knows; more: decoded


@dataclass(eq=False)
class _Scan:
    """One row's incremental decoding: output tokens [prefix, read) were decoded last step and
    gave the text already emitted; `tail` is the end of that text (longest stop - 1 chars)."""

    prefix: int = 0
    read: int = 0
    emitted: int = 0  # characters of text emitted so far
    pieces: list[str] = field(default_factory=list)
    tail: str = ""
    ends: str = ""  # the last characters of the row's stop strings; "" when it never skips
    skipped: int = 0  # output tokens [read, read + skipped) not decoded: none can end a stop


class StopChecker:
    """Decides after each new token whether a row is finished: end of sequence, a stop string
    (found in the decoded text, so also across token boundaries; the stop string and what
    follows are not returned), max_tokens, or the model's length limit.

    scanned_chars / decoded_tokens: what the last check of a row with stop strings searched
    and decoded (bounded per step; tests and benchmarks read them)."""

    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int,
                 batch_decode: bool = False) -> None:
        """batch_decode: decode many rows in one call into the tokenizer's thread pool. Not on
        the CPU path, whose forward's OpenMP threads hold the cores that pool would use: there
        the 1,374 decodes of a 256-row step-loop benchmark took 12-28 ms of wall time in
        batches of up to 85 rows and 5.5 ms row by row."""
        self.tokenizer = tokenizer
        self.batch_decode = batch_decode
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self._texts: dict[int, str | None] = {}  # token -> its text alone; None: it splits one
        self._sets: dict[str, int] = {}  # stop strings' last characters -> their row in _can
        self._can = np.full((0, 0), -1, dtype=np.int8)  # [set, token]: 1 may end one, 0 not,
        # -1 not known yet
        self.scanned_chars = 0
        self.decoded_tokens = 0

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def decode_many(self, batch: list[list[int]]) -> list[str]:
        """decode() of each, in one call where batches are used, the tokenizer has batch_decode
        and the batch is large enough to repay that call's fixed cost (~40 us: its thread
        pool)."""
        many = getattr(self.tokenizer, "batch_decode", None) if self.batch_decode else None
        if many is None or len(batch) < _BATCH_DECODE_FROM:
            return [self.decode(ids) for ids in batch]
        return many(batch, skip_special_tokens=True)

    def check(self, seq: Request) -> bool:
        """Sets seq.finish_reason (and seq.text for a stop string); True when finished.

        A constrained row also stops when its grammar is complete (even with ignore_eos: only
        end-of-sequence could follow), which wins over max_tokens reached by the same token."""
        return self.check_many([seq])[0]

    def skip_many(self, state: RowSlots, slots: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """check_many's skip over arrays, for rows (slots [C]) whose new tokens [C] are neither
        an end of sequence nor their last: [C] bool, True where the token cannot end one of the
        row's stop strings and its scan may leave it undecoded (as check_many would); those
        need no check_many this step."""
        ok = state.stop_skips[slots] > 0  # [C]
        at = ok.nonzero()[0]
        if not len(at):
            return ok
        self._widen(len(self._sets), int(tokens[at].max()) + 1)
        ok[at] = self._can[state.stop_ends[slots[at]], tokens[at]] == 0
        hit = slots[ok]
        state.stop_skips[hit] -= 1
        state.fast_skipped[hit] += 1
        return ok

    def _widen(self, sets: int, tokens: int) -> None:
        """_can made at least [sets, tokens] (doubling)."""
        have = self._can.shape
        if sets <= have[0] and tokens <= have[1]:
            return
        grown = np.full((max(sets, 2 * have[0]), max(tokens, 2 * have[1])), -1, dtype=np.int8)
        grown[: have[0], : have[1]] = self._can
        self._can = grown

    def _arm(self, seq: Request, scan: _Scan, n: int) -> None:
        """After a check of a row with stop strings (n: its output's length): how many tokens
        skip_many may leave undecoded next (0 unless its scan is caught up)."""
        st, s = seq.state, seq.slot
        number = self._sets.get(scan.ends, -1) if scan.ends else -1
        if scan.ends and number < 0 and len(self._sets) < _MAX_SETS:
            number = self._sets[scan.ends] = len(self._sets)
        caught_up = number >= 0 and scan.read + scan.skipped == n
        st.stop_skips[s] = _MAX_SKIP - scan.skipped if caught_up else 0
        st.stop_ends[s] = number

    def check_many(self, seqs: list[Request]) -> list[bool]:
        """check() of each sequence, the decodes of those with stop strings in one batch (one
        call into the tokenizer a step, not two per row)."""
        done = [False] * len(seqs)
        scanning = []  # (index, sequence, its scan, its output's length)
        for i, seq in enumerate(seqs):
            sp = seq.sampling
            token = seq.last_token
            eos = not sp.ignore_eos and token in self.eos_ids
            if eos or (seq.matcher is not None and seq.matcher.is_stopped()):
                seq.finish_reason = "stop"
                done[i] = True
            elif sp.stop:
                n = seq.num_generated
                scan = self._scan(seq, n)
                fast = seq.state.fast_skipped
                if fast[seq.slot]:  # tokens skip_many left undecoded
                    scan.skipped += int(fast[seq.slot])
                    fast[seq.slot] = 0
                if (scan.ends and scan.read + scan.skipped == n - 1 and scan.skipped < _MAX_SKIP
                        and not self._can_end(token, scan.ends)):
                    scan.skipped += 1
                    self.scanned_chars = self.decoded_tokens = 0
                    done[i] = self._length(seq)
                    self._arm(seq, scan, n)
                else:
                    scanning.append((i, seq, scan, n))
            else:
                done[i] = self._length(seq)
        if not scanning:
            return done
        batch = []
        for _, seq, scan, n in scanning:
            ids = seq.output(scan.prefix, n)
            if scan.read > scan.prefix:
                batch.append(ids[: scan.read - scan.prefix])
            batch.append(ids)
        texts = iter(self.decode_many(batch))
        for i, seq, scan, n in scanning:
            before = next(texts) if scan.read > scan.prefix else ""
            text = self._stop_text(seq, scan, n, before, next(texts))
            if text is not None:
                seq.text = text
                seq.finish_reason = "stop"
                done[i] = True
            else:
                done[i] = self._length(seq)
                self._arm(seq, scan, n)
        return done

    def _length(self, seq: Request) -> bool:
        if seq.total - seq.num_prompt_tokens >= seq.sampling.max_tokens or (
                seq.total >= self.max_model_len):
            seq.finish_reason = "length"
            return True
        return False

    def final_text(self, seq: Request) -> str:
        return self.final_texts([seq])[0]

    def final_texts(self, seqs: list[Request]) -> list[str]:
        """Each finished row's text: up to its stop string, else its output decoded (those in
        one batch)."""
        plain = [s for s in seqs if s.text is None]
        texts = iter(self.decode_many([s.output_ids for s in plain]))
        out = []
        for seq in seqs:
            seq.scan = None
            out.append(seq.text if seq.text is not None else next(texts))
        return out

    def _scan(self, seq: Request, n: int) -> _Scan:
        """The row's scan; n: its output's length."""
        scan = seq.scan
        if scan is None or scan.read + scan.skipped > n:  # seen first (or output replaced)
            stops = seq.sampling.stop
            spaced = any(s.endswith(" ") for s in stops)
            scan = seq.scan = _Scan(ends="" if spaced else "".join(sorted({s[-1] for s in stops})))
        return scan

    def _can_end(self, token: int, ends: str) -> bool:
        """Whether the token's text, decoded in context, may hold one of `ends`."""
        text = self._texts.get(token, "")
        if text == "":  # not seen yet
            text = self.decode([token])
            text = self._texts[token] = None if not text or "\ufffd" in text else text
        can = text is None or any(map(text.__contains__, ends))
        number = self._sets.get(ends)
        if number is not None:  # for skip_many
            self._widen(number + 1, token + 1)
            self._can[number, token] = can
        return can

    def _stop_text(self, seq: Request, scan: _Scan, n: int, before: str,
                   text: str) -> str | None:
        """The row's text before the first stop string, when one ends in this step's new text;
        else None. n: the output's length; before, text: the decodes of output tokens
        [scan.prefix, scan.read) and [scan.prefix, n)."""
        new, done = self._new_text(scan, n, before, text)
        window = scan.tail + new
        self.scanned_chars = len(window)
        hits = [i for i in (window.find(s) for s in seq.sampling.stop) if i >= 0]
        if hits:
            cut = scan.emitted - len(scan.tail) + min(hits)  # in the row's whole text
            return ("".join(scan.pieces) + new)[:cut]
        if done:  # else the same tokens are decoded again with the next one
            longest = max(map(len, seq.sampling.stop))
            scan.pieces.append(new)
            scan.emitted += len(new)
            scan.tail = window[max(len(window) - longest + 1, 0):]
        return None

    def _new_text(self, scan: _Scan, n: int, before: str, text: str
                  ) -> tuple[str, bool]:
        """(the text that output tokens [scan.read, n) add, whether it is final: the scan advances past
        those tokens). Not final while it ends inside a character, for up to _MAX_WAIT tokens."""
        self.decoded_tokens = 2 * (scan.read - scan.prefix) + n - scan.read
        new = text[len(before):]
        if (not new or new.endswith("\ufffd")) and n - scan.read - scan.skipped < _MAX_WAIT:
            return new, False
        scan.prefix, scan.read, scan.skipped = scan.read, n, 0
        return new, True
