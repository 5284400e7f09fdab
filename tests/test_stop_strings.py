"""engine/stopping.py: stop strings matched on the newly decoded text only, with the real
SmolLM2 tokenizer: a step decodes only rows whose new token may end a stop string, and then
searches at most the longest stop string's length - 1 characters plus the text of the tokens since
the row's last decode (a few tokens), however long the output; where it stops and the text it
returns are those of decoding the whole output and searching all of it."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hf_reference import smollm2_folder

from batchllm.engine.request import Kind, Request
from batchllm.engine.stopping import _MAX_SKIP, StopChecker
from batchllm.model.tokenizer import load_tokenizer
from batchllm.sampling_params import SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(smollm2_folder())


def _feed(checker: StopChecker, out: list[int], sp: SamplingParams, on_step=None,
          fast: list[int] | None = None):
    """The output fed one token at a time, as the engine does: (tokens taken, text, reason).
    fast: as the engine's StepTokens.resolve, a token that is neither an end of sequence nor
    the last goes first through skip_many, and only a token not skipped there to check_many;
    fast counts the tokens skipped so."""
    seq = Request(Kind.ROW, 0, [1, 3, 5], 3, sampling=sp)
    for k, tok in enumerate(out, 1):
        seq.append(tok)
        eos = not sp.ignore_eos and tok in checker.eos_ids
        if fast is not None and not eos and k < sp.max_tokens and checker.skip_many(
                seq.state, np.array([seq.slot]), np.array([tok]))[0]:
            fast.append(k)
            continue
        done = checker.check(seq)
        if on_step is not None:
            on_step(k)
        if done:
            return k, checker.final_text(seq), seq.finish_reason
    return len(out), checker.final_text(seq), None


def _reference(tokenizer, out: list[int], sp: SamplingParams):
    """Decode everything each step and search all of it (what the checker did before)."""
    for k in range(1, len(out) + 1):
        if not sp.ignore_eos and out[k - 1] == EOS:
            return k, tokenizer.decode(out[:k], skip_special_tokens=True), "stop"
        text = tokenizer.decode(out[:k], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in sp.stop) if i >= 0]
        if hits:
            return k, text[: min(hits)], "stop"
        if k >= sp.max_tokens:
            return k, text, "length"
    return len(out), tokenizer.decode(out, skip_special_tokens=True), None


def test_each_step_scans_the_new_text_and_a_stop_length_before_it(tokenizer) -> None:
    words = ("the parties agree that clause {} of the lease binds the tenant; "
             "payment is due on day {} of each month. ")
    text = "".join(words.format(i, i % 28 + 1) for i in range(400))
    out = tokenizer.encode(text, add_special_tokens=False)
    assert len(out) > 8000
    stops = ("<END OF THE CONTRACT>", "\n\n\n")  # never in the text
    longest = max(map(len, stops))
    sp = SamplingParams(max_tokens=len(out), stop=stops)
    checker = StopChecker(tokenizer, {EOS}, 100_000)
    scanned, bound, decoded = [], [], []
    lengths = [0]  # of the text of out[:k]: ASCII, so each token adds its own text
    assert "".join(tokenizer.decode([t]) for t in out) == text
    last = [0]  # the step of the last decode

    def on_step(k: int) -> None:
        lengths.append(lengths[-1] + len(tokenizer.decode([out[k - 1]])))
        scanned.append(checker.scanned_chars)
        decoded.append(checker.decoded_tokens)
        if checker.decoded_tokens:
            bound.append(min(longest - 1, lengths[last[0]]) + lengths[k] - lengths[last[0]])
            last[0] = k
        else:
            bound.append(0)

    taken, got, reason = _feed(checker, out, sp, on_step)
    assert (taken, reason) == (len(out), "length") and got == text
    assert all(s <= b for s, b in zip(scanned, bound)), max(s - b for s, b in zip(scanned, bound))
    # neither '>' nor a newline is in the text: a row is decoded once every _MAX_SKIP + 1 tokens
    assert sum(d > 0 for d in decoded) <= len(out) // (_MAX_SKIP + 1) + 1
    assert max(decoded) <= 3 * (_MAX_SKIP + 1)  # the tokens since the last decode, and those before


@pytest.mark.parametrize("fast", [False, True], ids=["check_many", "skip_many-first"])
def test_a_stop_is_found_where_a_whole_search_finds_it(tokenizer, fast: bool) -> None:
    """Random outputs (byte-level tokens that split characters, special tokens, end of
    sequence) and stop strings cut from their own text: the same step, text and reason; also
    with the engine's array skip first (one checker for all trials: the tokens it has seen are
    known)."""
    rng = random.Random(0)
    skipped: list[int] | None = [] if fast else None
    shared = StopChecker(tokenizer, {EOS}, 100_000)
    base = "Le café coûte 3 €. 東京の天気は晴れ🙂. Clause 7(b): the tenant pays.\n\n"
    pool = tokenizer.encode(base * 3, add_special_tokens=False)
    pool += [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")]
    checked = 0
    for trial in range(300):
        out = [rng.choice(pool) for _ in range(rng.randint(5, 60))]
        text = tokenizer.decode(out, skip_special_tokens=True)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text) or 1)
            piece = text[a : a + rng.randint(1, 6)]
            if piece and "\ufffd" not in piece:
                stops.append(piece)
        sp = SamplingParams(max_tokens=rng.randint(3, 70), stop=stops or ["zz"],
                            ignore_eos=trial % 2 == 0)
        want = _reference(tokenizer, out, sp)
        checker = shared if fast else StopChecker(tokenizer, {EOS}, 100_000)
        assert _feed(checker, out, sp, fast=skipped) == want, (out, sp.stop)
        checked += want[2] == "stop"
    assert checked > 100  # most trials end at a stop string (the rest: max_tokens)
    assert not fast or len(skipped) > 300  # the array path did skip


def test_a_stop_ending_in_a_space_is_found_where_a_metaspace_token_adds_it() -> None:
    """SentencePiece-style tokens decode alone without their leading space ('of', not ' of'):
    a stop string ending in a space must still end at the token that adds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1}
    for word in ("the", "end", "of", "lease", "tenant", "pays"):
        vocab["\u2581" + word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    out = tok.encode("the end of the lease the tenant pays the end", add_special_tokens=False)
    assert tok.decode([out[2]]) == "of"  # alone, without the space it adds in context
    for stops in (["end "], ["end ", "pays"], ["lease the"]):
        sp = SamplingParams(max_tokens=len(out), stop=stops, ignore_eos=True)  # EOS is id 2 there
        want = _reference(tok, out, sp)
        assert want[2] == "stop"
        assert _feed(StopChecker(tok, {1}, 100_000), out, sp) == want, stops


class _CountingTokenizer:
    """The tokenizer, counting its calls to batch_decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.batches = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens=False):
        self.batches += 1
        return self.tokenizer.batch_decode(seqs, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("batch_decode", [False, True], ids=["row-by-row", "batched"])
def test_rows_checked_together_stop_where_each_alone_would(tokenizer, batch_decode) -> None:
    """48 rows fed in lockstep and checked in one check_many a step, as the engine does: the
    tokenizer's batch decode (on GPU hosts) or one decode per row (the CPU path, where the
    forward's threads hold the cores) gives each row the step, text and reason of a whole
    search."""
    rng = random.Random(1)
    counting = _CountingTokenizer(tokenizer)
    checker = StopChecker(counting, {EOS}, 100_000, batch_decode=batch_decode)
    pool = tokenizer.encode("Clause 7(b): the tenant pays 3 € a day.\n\n" * 3,
                            add_special_tokens=False)
    outs, seqs, want = [], [], []
    for key in range(48):
        out = [rng.choice(pool) for _ in range(rng.randint(20, 60))]
        text = tokenizer.decode(out, skip_special_tokens=True)
        a = rng.randrange(len(text))
        stop = [text[a : a + rng.randint(2, 6)]]
        if key % 4:  # a stop string ending in a space, never met: decoded every step, so that
            # a step decodes more rows than _BATCH_DECODE_FROM whatever _MAX_SKIP is
            stop.append("zq ")
        sp = SamplingParams(max_tokens=len(out), stop=stop, ignore_eos=True)
        outs.append(out)
        seqs.append(Request(Kind.ROW, key, [1, 3, 5], 3, sampling=sp))
        want.append(_reference(tokenizer, out, sp))
    got = [None] * len(seqs)
    running = list(range(len(seqs)))
    for k in range(1, 61):
        for i in running:
            seqs[i].append(outs[i][k - 1])
        done = checker.check_many([seqs[i] for i in running])
        for i, d in zip(list(running), done):
            if d:
                got[i] = (k, checker.final_text(seqs[i]), seqs[i].finish_reason)
                running.remove(i)
        if not running:
            break
    assert got == want
    assert (counting.batches > 0) == batch_decode
