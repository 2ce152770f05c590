"""Incremental detokenizer (streamed pieces == full decode) and stop-sequence matching."""
import pytest

pytest.importorskip("torch")
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402

from engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from engine.stop import StopMatcher  # noqa: E402
from fakes import test_model_path  # noqa: E402

TEXTS = [
    "héllo wörld, naïve café — “quotes” … ÿ ß ø",
    "Emoji: 😀👍🏽 and 🇫🇷 flags, 👨‍👩‍👧 family",
    "日本語のテキストと한국어 텍스트",
    "  leading and  double  spaces\nnew line\ttab ",
    "math: ∑ x² ≤ ∞, arrows → ⇒",
]


@pytest.fixture(scope="module")
def smollm2():
    return AutoTokenizer.from_pretrained(test_model_path("smollm2"))


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama-style tokenizer: ▁ for spaces, byte fallback, leading space stripped on decode."""
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([topics[k][:3000] for k in sorted(topics)[:60]], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(tokenizer, prompt_ids, generated_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, len(prompt_ids), skip_special_tokens)
    ids, pieces = list(prompt_ids), []
    for token in generated_ids:
        ids.append(token)
        pieces.append(detok.decode_next(ids))
    pieces.append(detok.flush(ids))
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_pieces_concatenate_to_the_full_decode(smollm2, text):
    prompt = smollm2.encode("Write something:")
    generated = smollm2.encode(" " + text, add_special_tokens=False)
    pieces = stream(smollm2, prompt, generated)
    assert "".join(pieces) == smollm2.decode(generated) == " " + text
    assert not any("\ufffd" in piece for piece in pieces)


def test_split_characters_are_held_back_until_complete(smollm2):
    generated = smollm2.encode("😀👍🏽日本", add_special_tokens=False)
    assert len(generated) > 4          # several byte tokens per character
    pieces = stream(smollm2, smollm2.encode("Hi"), generated)
    assert "" in pieces[:-1]
    assert "".join(pieces) == "😀👍🏽日本"


def test_generation_cut_mid_character_flushes_a_replacement(smollm2):
    generated = smollm2.encode(" 😀", add_special_tokens=False)[:-1]
    pieces = stream(smollm2, smollm2.encode("Hi"), generated)
    assert "".join(pieces) == smollm2.decode(generated)
    assert pieces[-1].endswith("\ufffd")


def test_special_tokens_follow_skip_special_tokens(smollm2):
    prompt = smollm2.encode("Hi")
    generated = smollm2.encode(" ok", add_special_tokens=False) + [smollm2.eos_token_id]
    assert "".join(stream(smollm2, prompt, generated)) == " ok"
    assert "".join(stream(smollm2, prompt, generated, skip_special_tokens=False)) == " ok" + smollm2.eos_token


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_spaces_and_byte_fallback(sentencepiece_like, text):
    tok = sentencepiece_like
    prompt = tok.encode("The answer is", add_special_tokens=False)
    generated = tok.encode(text, add_special_tokens=False)      # starts with "▁": a word start
    # the byte tokens are registered as special here, so keep specials to decode them
    pieces = stream(tok, prompt, generated, skip_special_tokens=False)
    # the leading space that a lone decode(generated) strips is kept: the prompt gives the context
    assert tok.decode(generated) == text
    assert "".join(pieces) == " " + text
    assert "".join(pieces) == tok.decode(prompt + generated)[len(tok.decode(prompt)):]
    assert not any("\ufffd" in piece for piece in pieces)


# stop sequences
def feed_all(matcher, pieces):
    out, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(matcher.flush())
    return out, stopped


def test_stop_across_pieces_cuts_before_it_and_never_streams_it():
    matcher = StopMatcher(["\nUser:"])
    out, stopped = feed_all(matcher, ["Hello", " there\n", "Us", "er", ": more"])
    assert stopped
    assert matcher.text == "Hello there"
    assert "".join(out) == "Hello there"
    assert out[1] == " there"            # the newline waits: it may start the stop string


def test_held_back_text_is_released_when_it_stops_matching():
    matcher = StopMatcher(["STOP"])
    out, stopped = feed_all(matcher, ["a S", "T", "x", "y"])
    assert not stopped
    assert out == ["a ", "", "STx", "y", ""]
    assert matcher.text == "a STxy"


def test_earliest_of_several_stops_wins():
    matcher = StopMatcher(["world", "lo w"])
    _, stopped = feed_all(matcher, ["hel", "lo world"])
    assert stopped and matcher.text == "hel"


def test_stop_inside_a_single_piece_and_at_the_start():
    matcher = StopMatcher(["."])
    out, stopped = feed_all(matcher, ["One. Two."])
    assert stopped and out == ["One"]
    matcher = StopMatcher(["###"])
    out, stopped = feed_all(matcher, ["###", "x"])
    assert stopped and matcher.text == "" and out == [""]


def test_no_stop_strings_passes_text_through():
    matcher = StopMatcher([])
    assert feed_all(matcher, ["a", "b"]) == (["a", "b", ""], False)


# the DecodeStream path against the Python one, on hostile token sequences
def stream_both(tokenizer, prompt_ids, generated_ids, skip_special_tokens=True, pieces=True):
    """Pieces from the DecodeStream path (with the per-token pieces of a byte-level decoder unless `pieces` is
    False) and from the Python path; fails if the stream path is not taken."""
    fast = IncrementalDetokenizer(tokenizer, len(prompt_ids), skip_special_tokens)
    slow = IncrementalDetokenizer(tokenizer, len(prompt_ids), skip_special_tokens)
    assert fast._use_stream, "this tokenizer should take the DecodeStream path"
    slow._use_stream, slow._pieces = False, None
    if not pieces:
        fast._pieces = None
    ids, fast_pieces, slow_pieces = list(prompt_ids), [], []
    for token in generated_ids:
        ids.append(token)
        fast_pieces.append(fast.decode_next(ids))
        slow_pieces.append(slow.decode_next(ids))
    fast_pieces.append(fast.flush(ids))
    slow_pieces.append(slow.flush(ids))
    return fast_pieces, slow_pieces


HOSTILE = ["👨‍👩‍👧 family 🇫🇷🏳️‍🌈", "a\u0301e\u0301 combining", "\x00\x01 control \x7f", "  \n\n  ", "日本語😀x"]


@pytest.mark.parametrize("text", HOSTILE + TEXTS)
def test_stream_path_gives_the_same_pieces_as_the_python_path(smollm2, text):
    prompt = smollm2.encode("Say:")
    generated = smollm2.encode(text, add_special_tokens=False)
    fast, slow = stream_both(smollm2, prompt, generated)
    assert fast == slow
    assert "".join(fast) == smollm2.decode(prompt + generated)[len(smollm2.decode(prompt)):]


def test_stream_path_on_random_ids_specials_and_ids_past_the_vocab(smollm2):
    import random
    rng = random.Random(0)
    vocab = len(smollm2)
    specials = sorted(set(smollm2.all_special_ids))
    emoji = smollm2.encode("😀🇫🇷", add_special_tokens=False)
    for trial in range(40):
        generated = []
        for _ in range(rng.randint(1, 30)):
            kind = rng.random()
            if kind < 0.15:
                generated.append(rng.choice(specials))
            elif kind < 0.2:
                generated.append(vocab + rng.randint(0, 1000))      # a padded embedding row: decodes to ""
            elif kind < 0.4:
                generated += emoji[:rng.randint(1, len(emoji))]     # characters cut anywhere
            else:
                generated.append(rng.randrange(vocab))
        for skip in (True, False):
            for pieces in (True, False):
                fast, slow = stream_both(smollm2, smollm2.encode("Hi there"), generated, skip, pieces)
                assert fast == slow, (trial, generated, skip, pieces)


def test_byte_level_pieces_only_for_whole_characters(smollm2):
    from engine.detokenizer import token_pieces
    table = token_pieces(smollm2, True)
    assert table is not None and table is token_pieces(smollm2, True) is not token_pieces(smollm2, False)
    split = smollm2.encode(" 😀", add_special_tokens=False)
    assert all(table.get(i) == "" for i in split if "\ufffd" in smollm2.decode([i]))
    assert table.get(smollm2.eos_token_id) == "" and token_pieces(smollm2, False).get(smollm2.eos_token_id)
    assert table.get(-1) == table.get(len(smollm2) + 5) == ""
    # a prompt that ends inside a character: the next whole-character token is still its own piece
    prompt = smollm2.encode("Hi 😀", add_special_tokens=False)[:-1] + smollm2.encode(" there", add_special_tokens=False)
    fast, slow = stream_both(smollm2, prompt[:-1], prompt[-1:] + smollm2.encode(" ok", add_special_tokens=False))
    assert fast == slow


def test_sentencepiece_decoders_take_no_pieces(sentencepiece_like):
    from engine.detokenizer import token_pieces
    assert token_pieces(sentencepiece_like, True) is None


def test_stream_path_holds_an_emoji_split_over_byte_tokens(smollm2):
    generated = smollm2.encode(" 😀!", add_special_tokens=False)
    assert len(generated) >= 3
    fast, slow = stream_both(smollm2, smollm2.encode("Hi"), generated)
    assert fast == slow
    assert "".join(fast) == " 😀!" and "" in fast[:-1] and not any("\ufffd" in p for p in fast)


@pytest.mark.parametrize("text", HOSTILE + TEXTS)
def test_stream_path_with_byte_fallback_tokens(sentencepiece_like, text):
    tok = sentencepiece_like
    prompt = tok.encode("The answer is", add_special_tokens=False)
    generated = tok.encode(text, add_special_tokens=False)
    assert any(tok.convert_ids_to_tokens(i).startswith("<0x") for i in generated) or text.isascii()
    fast, slow = stream_both(tok, prompt, generated, skip_special_tokens=False)
    assert fast == slow
    assert "".join(fast) == tok.decode(prompt + generated)[len(tok.decode(prompt)):]


def test_stream_path_cut_mid_character_flushes_like_the_python_path(sentencepiece_like):
    tok = sentencepiece_like
    generated = tok.encode(" 😀", add_special_tokens=False)[:-1]
    fast, slow = stream_both(tok, tok.encode("Hi", add_special_tokens=False), generated, skip_special_tokens=False)
    assert fast == slow and fast[-1].endswith("\ufffd")


def test_python_path_takes_over_when_the_stream_refuses(smollm2):
    class Refusing:
        def step(self, tokenizer, ids):
            raise Exception("InvalidPrefix")

    prompt, generated = smollm2.encode("Hi"), smollm2.encode(" fine 😀 day", add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2, len(prompt))
    ids, pieces = list(prompt), []
    for i, token in enumerate(generated):
        ids.append(token)
        if i == 2:
            detok._stream = Refusing()
        pieces.append(detok.decode_next(ids))
    pieces.append(detok.flush(ids))
    assert not detok._use_stream
    assert "".join(pieces) == " fine 😀 day"


def test_stream_path_takes_several_new_tokens_at_once(smollm2):
    prompt = smollm2.encode("Hi")
    generated = smollm2.encode(" one 😀 two three", add_special_tokens=False)
    fast = IncrementalDetokenizer(smollm2, len(prompt))
    slow = IncrementalDetokenizer(smollm2, len(prompt))
    slow._use_stream = False
    ids, fast_pieces, slow_pieces = list(prompt), [], []
    for i in range(0, len(generated), 3):
        ids += generated[i:i + 3]
        fast_pieces.append(fast.decode_next(ids))
        slow_pieces.append(slow.decode_next(ids))
    assert fast._use_stream and fast_pieces == slow_pieces
    assert "".join(fast_pieces) + fast.flush(ids) == " one 😀 two three"


def test_text_without_stop_strings_is_every_piece_and_reads_at_any_time():
    matcher = StopMatcher([])
    pieces = ["Hel", "", "lo", " wörld", "\ufffd"]
    for i, piece in enumerate(pieces):
        assert matcher.feed(piece) == (piece, False)
        assert matcher.text == "".join(pieces[:i + 1])
    assert matcher.flush() == "" and matcher.cut == ""
