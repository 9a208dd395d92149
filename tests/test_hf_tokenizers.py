"""Any Hugging Face tokenizer: the tokenizers of Llama 3, Mixtral / Llama 2 and DeepSeek-V3 (built
here in each family's style by tests/family_tokenizers.py; nothing downloaded) load with the BOS
and EOS their families train with; documents are BOS + text + EOS; transformers encodes text as
moetrain does; and tokenize → train → export carries the ids and the tokenizer files through.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetrain.config import save_config
from moetrain.data.format import read_manifest
from moetrain.data.pipeline import TokenizeJob
from moetrain.data.tokenizer import TokenizerError, canonical_sha256, load_tokenizer
from moetrain.data.writer import encode_documents, write_shards

from conftest import ByteTokenizer, tiny_config
from family_tokenizers import CORPUS, FAMILIES
from multiproc import run_distributed

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Hello world, it's 2025: 12345 tokens. Über ✓ 🎭 \t  spaces\nnew line"
# (BOS id, EOS id) where the family puts them first in the vocabulary (Llama 3 appends its specials).
LEADING_IDS = {"mixtral": (1, 2), "deepseek_v3": (0, 1)}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
RENDERED = {  # each family's own turn format, with its generation prompt
    "llama3": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
              "\n\nHello.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nBye?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mixtral": "<s>[INST] Be brief.\n\nHi? [/INST]Hello.</s>[INST] Bye? [/INST]",
    "deepseek_v3": "<｜begin▁of▁sentence｜>Be brief.<｜User｜>Hi?<｜Assistant｜>Hello."
                   "<｜end▁of▁sentence｜><｜User｜>Bye?<｜Assistant｜>",
}
# What add_generation_prompt appends (Mistral's user turn already ends with the prompt, [/INST]).
GENERATION_PROMPT = {"llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "mixtral": "",
                     "deepseek_v3": "<｜Assistant｜>"}


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name) for name, (build, _, _) in FAMILIES.items()}


def _edit_config(directory: Path, **changes) -> None:
    path = directory / "tokenizer_config.json"
    conf = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**conf, **changes}, ensure_ascii=False), encoding="utf-8")


def _document(tok, text: str) -> list[int]:
    return encode_documents(tok, [text], np.dtype("<u4"))[0].tolist()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_loads_with_its_bos_and_eos(family, families, tmp_path):
    _, bos, eos = FAMILIES[family]
    tok = load_tokenizer(families[family])
    assert (tok.bos_id, tok.eos_id) == (tok.hf.token_to_id(bos), tok.hf.token_to_id(eos))
    if family in LEADING_IDS:  # SentencePiece's <unk> <s> </s>, DeepSeek's BOS / EOS
        assert (tok.bos_id, tok.eos_id) == LEADING_IDS[family]
    assert _document(tok, TEXT) == [tok.bos_id] + tok.encode(TEXT) + [tok.eos_id]
    assert tok.decode(tok.encode(TEXT)) == TEXT
    # The framing is part of the identity: the same tokenizer.json with another one is another tokenizer.
    assert tok.identity["sha256"] != canonical_sha256(tok.hf)
    # The file, its directory and a model directory (config.json beside) are one tokenizer.
    assert load_tokenizer(families[family] / "tokenizer.json").identity == tok.identity
    model_dir = shutil.copytree(families[family], tmp_path / family)
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    assert load_tokenizer(model_dir).identity == tok.identity


@pytest.mark.parametrize("family", list(FAMILIES))
def test_special_token_strings_in_text_stay_text(family, families):
    tok = load_tokenizer(families[family])
    specials = {t.content for t in tok.hf.get_added_tokens_decoder().values() if t.special}
    text = "a" + "b".join(sorted(specials)) + "c"
    clone = pickle.loads(pickle.dumps(tok))  # as worker processes and SLURM tasks get it
    for t in (tok, clone):
        ids = t.encode_batch([text])[0]
        assert not set(ids) & {tok.hf.token_to_id(s) for s in specials}
        assert t.decode(ids) == text
    assert _document(clone, text) == _document(tok, text)


def test_bos_decision_follows_add_bos_token_else_the_post_processor(families, tmp_path):
    # Llama 3 has no add_bos_token: its post-processor adds <|begin_of_text|>; the key, when there, decides.
    llama = shutil.copytree(families["llama3"], tmp_path / "llama3")
    with_bos = load_tokenizer(llama)
    _edit_config(llama, add_bos_token=False)
    without = load_tokenizer(llama)
    assert without.bos_id is None and without.eos_id == with_bos.eos_id
    assert without.identity["sha256"] != with_bos.identity["sha256"]  # the pipeline redoes its units
    assert _document(without, TEXT) == without.encode(TEXT) + [without.eos_id]
    # Mixtral's add_bos_token: true adds <s> even when the tokenizer.json has no post-processor.
    mixtral = shutil.copytree(families["mixtral"], tmp_path / "mixtral")
    tj = json.loads((mixtral / "tokenizer.json").read_text(encoding="utf-8"))
    (mixtral / "tokenizer.json").write_text(json.dumps({**tj, "post_processor": None}), encoding="utf-8")
    assert load_tokenizer(mixtral).bos_id == 1
    # Only special_tokens_map.json left: EOS from there, BOS from the post-processor.
    (llama / "tokenizer_config.json").unlink()
    from_map = load_tokenizer(llama)
    assert (from_map.bos_id, from_map.eos_id) == (with_bos.bos_id, with_bos.eos_id)


def test_tokenizers_that_cannot_frame_documents_are_refused(families, tmp_path):
    llama = shutil.copytree(families["llama3"], tmp_path / "llama3")
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        (llama / f).unlink()
    with pytest.raises(TokenizerError, match=r"no end-of-document token: neither tokenizer_config.json nor "
                                             r"special_tokens_map.json .* no <\|endoftext\|>.*Fix: .*eos_token"):
        load_tokenizer(llama)
    (llama / "tokenizer_config.json").write_text('{"eos_token": "</eos>"}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: eos_token '</eos>' is not in .*tokenizer.json"):
        load_tokenizer(llama)
    (llama / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>", "add_bos_token": true}')
    with pytest.raises(TokenizerError, match="add_bos_token is true but no bos_token is named"):
        load_tokenizer(llama)
    (llama / "tokenizer_config.json").write_text('{"eos_token": {"no": "content"}}')
    with pytest.raises(TokenizerError, match=r"eos_token = .* is neither a token string nor"):
        load_tokenizer(llama)


def test_manifests_record_bos_and_older_ones_read_as_none(tmp_path):
    manifest = write_shards(CORPUS[:20], ByteTokenizer(), tmp_path, val_docs=2, progress=False)
    assert manifest["bos_id"] is None and read_manifest(tmp_path)["bos_id"] is None
    older = {k: v for k, v in manifest.items() if k != "bos_id"}  # written before bos_id was recorded
    (tmp_path / "manifest.json").write_text(json.dumps(older))
    assert read_manifest(tmp_path)["bos_id"] is None


def test_transformers_encodes_and_chats_as_moetrain(families, monkeypatch):
    """What transformers makes of each directory: the same ids, BOS and EOS, and the family's
    chat format (the templates another engineer's chat data will be rendered with)."""
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for family, directory in families.items():
        ours = load_tokenizer(directory)
        theirs = AutoTokenizer.from_pretrained(str(directory))
        assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id), family
        for text in (TEXT, *CORPUS[:20]):
            assert theirs(text)["input_ids"] == _document(ours, text)[:-1], (family, text)
        rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert rendered == RENDERED[family], family
        plain = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
        assert plain + GENERATION_PROMPT[family] == rendered, family


# -- tokenize → train → export -------------------------------------------------------------------


def train_and_save(rank: int, world: int, cfgs: list) -> list[list[float]]:
    """Two steps on each config's data, then a checkpoint; the losses of each."""
    from moetrain.train.trainer import Trainer

    losses = []
    for cfg in cfgs:
        trainer = Trainer(cfg, write_files=False)
        losses.append([trainer.train_step().loss for _ in range(2)])
        trainer.save_checkpoint()
    return losses


@pytest.mark.slow
def test_tokenize_train_export_each_family(families, tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoTokenizer

    from moetrain.hf.__main__ import main as hf_main

    docs = CORPUS[:80] + ["A document with <s>, </s>, <|end_of_text|> and <｜end▁of▁sentence｜> in it."]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    cfgs = {}
    for family, directory in families.items():
        tok_dir = shutil.copytree(directory, tmp_path / family / "tokenizer")  # beside the data, where export looks
        shards = tmp_path / family / "shards"
        if family == "llama3":  # the command line, with the tokenizer directory as the spec
            proc = subprocess.run([sys.executable, "tools/tokenize_corpus.py", "--input", str(corpus), "--tokenizer",
                                   str(tok_dir), "--out", str(shards), "--val-docs", "4", "--workers", "0", "--quiet"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr
        else:  # the pipeline in this process
            job = TokenizeJob([corpus], load_tokenizer(tok_dir), shards, val_docs=4)
            job.run(workers=0, progress=False)
            job.merge(progress=False)
        tok = load_tokenizer(tok_dir)
        manifest = read_manifest(shards)
        assert (manifest["bos_id"], manifest["eos_id"], manifest["tokenizer"]) == (tok.bos_id, tok.eos_id, tok.identity)
        # Every document in the shards is BOS + text + EOS: the first four are the val split.
        starts = np.fromfile(shards / "train_00000.idx", dtype="<i8")
        ids = np.fromfile(shards / "train_00000.bin", dtype=manifest["dtype"]).astype(np.int64)
        bounds = list(starts) + [len(ids)]
        written = [ids[a:b].tolist() for a, b in zip(bounds, bounds[1:])]
        assert written == [_document(tok, d) for d in docs[4:]], family
        run_dir = tmp_path / family / "run"
        cfg = tiny_config(shards, run_dir, model={"vocab_size": tok.vocab_size}, moe={"shared_experts": 0},
                          train={"steps": 2, "global_batch_size": 4})
        save_config(cfg, run_dir / "config.yaml")  # as submit writes it; export finds it there
        cfgs[family] = cfg
    losses = run_distributed(train_and_save, 1, list(cfgs.values()))[0]
    assert all(0 < loss < 20 for run in losses for loss in run), losses

    for family, directory in families.items():
        out = tmp_path / family / "export"
        assert hf_main(["export", str(tmp_path / family / "run" / "checkpoints"), "--out", str(out)]) == 0
        tok = load_tokenizer(directory)
        conf = json.loads((out / "config.json").read_text())
        assert (conf["bos_token_id"], conf["eos_token_id"]) == (tok.bos_id, tok.eos_id), family
        for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (out / f).read_bytes() == (directory / f).read_bytes(), (family, f)
        exported = AutoTokenizer.from_pretrained(str(out))
        assert (exported.bos_token_id, exported.eos_token_id) == (tok.bos_id, tok.eos_id)
        assert exported(TEXT)["input_ids"] == _document(tok, TEXT)[:-1]
        assert load_tokenizer(out).identity["sha256"] == tok.identity["sha256"]
