import json
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from gptforge.core.config import dump_config
from gptforge.core.errors import DataError
from gptforge.data.parallel import in_process
from gptforge.data.shards import TokenStream, read_index
from gptforge.pipeline.store import execute, locate
from gptforge.stages import tokenize
from gptforge.model.train.metrics import MEASURED
from tests.helpers import free_port

MIXED = ["Hello world, 23 plus 45 is 68.", "你好，世界！中文文本。", "emoji 🙂🚀 and ünïcödé",
         "tabs\tand  double  spaces", "العربية والعبرية עברית"]


@pytest.fixture
def corpus(tmp_path):
    rows = [{"text": MIXED[i % len(MIXED)] + f" doc {i}"} for i in range(400)]
    path = tmp_path / "corpus.jsonl"
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            if i == 10:
                f.write('{"text": 5}\n')  # bad row at line 12
    return path, [r["text"] for r in rows]


def decode_split(out_dir, split: str) -> list[str]:
    """The documents of a split, decoded from its shards in order."""
    tok = AutoTokenizer.from_pretrained(out_dir / "tokenizer")
    stream = TokenStream(out_dir / "shards", split)
    tokens, eos = stream[0:len(stream)], read_index(out_dir / "shards")["eos_id"]
    ends = np.flatnonzero(tokens == eos)
    return [tok.decode(tokens[a:b].tolist()) for a, b in zip([0, *(ends[:-1] + 1)], ends)]


def test_tokenize_stage_end_to_end(small_cfg, corpus, capsys):
    path, docs = corpus
    cfg = small_cfg(f"data.pretrain={path}", "tokenizer.shard_tokens=2000")
    manifest = execute(cfg, "tokenize")
    out_dir = locate(cfg, "tokenize")[0]
    m = manifest["metrics"]
    assert m["bad_rows"] == 1 and f"{path}:12: skipped bad text row" in capsys.readouterr().err
    assert m["vocab_size"] == 320 and m["tokens"] == m["train_tokens"] + m["val_tokens"] > 0
    assert m["bytes"] == sum(len(d.encode()) for d in docs) and m["tokens_per_sec"] > 0
    assert m["documents"] == len(docs) and 0 < m["unigram_entropy"] < np.log(320)

    tok = AutoTokenizer.from_pretrained(out_dir / "tokenizer")
    for text in MIXED:
        assert tok.decode(tok(text)["input_ids"]) == text

    index = read_index(out_dir / "shards")
    assert index["dtype"] == "uint16" and len(index["splits"]["train"]) > 1  # several shards
    train, val = decode_split(out_dir, "train"), decode_split(out_dir, "val")
    assert sorted(train + val) == sorted(docs) and train == [d for d in docs if d in set(train)]  # corpus order
    assert 0 < len(val) < 0.15 * len(docs) and not set(val) & set(train)


def test_the_split_and_tokenizer_are_the_same_whatever_the_run_seed(small_cfg, corpus, tmp_path):
    """tokenize is unseeded (one output serves every run.seed of a store, its fingerprint without the seed): two
    stores tokenized first at seed 1 and at seed 0 hold the same tokenizer and the same train and val documents
    (the split took run.seed, and a store's val set was whichever seed tokenized first)."""
    path, _ = corpus
    outs = []
    for seed in (1, 0):
        cfg = small_cfg(f"data.pretrain={path}", f"run.seed={seed}", f"run.root={tmp_path / f'seed{seed}'}")
        execute(cfg, "tokenize")
        outs.append(locate(cfg, "tokenize")[0])
    assert outs[0].name == outs[1].name  # one fingerprint
    tokenizers = [(out / "tokenizer" / "tokenizer.json").read_bytes() for out in outs]
    assert tokenizers[0] == tokenizers[1]
    for split in ("train", "val"):
        assert decode_split(outs[0], split) == decode_split(outs[1], split), split


def test_a_bad_row_fails_the_stage_when_asked(small_cfg, corpus):
    path, _ = corpus
    with pytest.raises(DataError, match=rf"^{path}:12: bad text row: field 'text' should be a string, got int \(data"):
        execute(small_cfg(f"data.pretrain={path}", "data.on_bad_row=fail"), "tokenize")


@contextmanager
def this_process(address, workers, units):
    """tokenize's engine for units encoded in this process rather than on Ray."""
    yield in_process


@pytest.fixture
def units_in_this_process(monkeypatch):
    """The stage's units encoded in this process rather than on a local Ray instance (a few seconds to start, and
    not what these tests are about; the Ray path: test_a_ray_cluster_writes_the_same_shards_and_tokenizer_as_this_
    process below, tests/pipeline/test_two_hosts.py (a cluster across two hosts), and test_listening.py)."""
    monkeypatch.setattr(tokenize, "engine", this_process)


def test_bpe_trains_on_a_sample_drawn_across_the_whole_corpus(small_cfg, tmp_path, capsys, units_in_this_process):
    """Two files, each of words the other lacks: a sample of a tenth of the corpus still holds both."""
    for name, words in (("a.txt", "ant bee cat"), ("z.txt", "xylophone yak zebra")):
        (tmp_path / name).write_text("".join(f"{words} {i}\n" for i in range(2000)))
    size = sum((tmp_path / n).stat().st_size for n in ("a.txt", "z.txt"))
    cfg = small_cfg(f"data.pretrain={tmp_path}/*.txt", f"tokenizer.train_sample_bytes={size // 10}")
    execute(cfg, "tokenize")
    sampled = int(re.search(r"documents \(([\d,]+) bytes\)", capsys.readouterr().out).group(1).replace(",", ""))
    assert size // 10 - 100 <= sampled <= size // 10
    tok = AutoTokenizer.from_pretrained(locate(cfg, "tokenize")[0] / "tokenizer")
    for word in ("xylophone", " zebra", "ant", " bee"):  # words of both files are whole tokens
        assert len(tok.tokenize(word)) == 1, word


def test_a_killed_stage_reruns_only_its_unfinished_units(small_cfg, tmp_path, units_in_this_process):
    for k in range(4):
        (tmp_path / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": f"document {k} {i} " * 3}) + "\n"
                                                         for i in range(300)))
    cfg = small_cfg(f"data.pretrain={tmp_path}/*.jsonl")
    first = execute(cfg, "tokenize")["metrics"]
    out_dir = locate(cfg, "tokenize")[0]
    shards = out_dir / "shards"
    before = {f.name: f.read_bytes() for f in shards.glob("*.bin")}
    # killed while encoding unit 2: its record not written, a half-written temporary and a truncated file left
    for f in ("manifest.json", "result.json", "shards/index.json", "shards/units/00002.json"):
        (out_dir / f).unlink()
    (shards / ".train-00002-000.bin.tmp").write_bytes(b"\0" * 10)
    (shards / "train-00002-000.bin").write_bytes(before["train-00002-000.bin"][:7])
    stamps = {f.name: f.stat().st_mtime_ns for f in shards.glob("*.bin")}
    again = execute(cfg, "tokenize")["metrics"]
    assert {f.name: f.read_bytes() for f in shards.glob("*.bin")} == before
    assert not list(shards.glob(".*.tmp"))
    rewritten = {f.name for f in shards.glob("*.bin") if f.stat().st_mtime_ns != stamps.get(f.name)}
    assert rewritten == {n for n in before if n.split("-")[1] == "00002"}  # the other units were kept
    assert {k: v for k, v in again.items() if k not in MEASURED} == {
        k: v for k, v in first.items() if k not in MEASURED}


@pytest.mark.slow
def test_a_ray_cluster_writes_the_same_shards_and_tokenizer_as_this_process(small_cfg, tmp_path, monkeypatch):
    """The same corpus tokenized on a 2-CPU Ray cluster started here on 127.0.0.1 (`tokenizer.cluster`: the stage
    connects to it or fails) and unit by unit in this process: the same fingerprint (where it runs is not what it
    is), token for token the same shards and byte for byte the same tokenizer.json. (Across two hosts:
    tests/pipeline/test_two_hosts.py; the stage's own local instance: tests/pipeline/test_listening.py.)"""
    import os
    import shutil
    import signal
    import socket
    import tempfile

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for k in range(5):
        (corpus / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": f"{w} number {i} of part {k}"}) + "\n"
                                                        for i, w in enumerate(MIXED * 60)))
    port = free_port()
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # the head's logs (short: Ray's socket paths live there)
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                             "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                             f"--temp-dir={temp}", "--include-dashboard=false", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            # (a head started by hand makes a token where ~/.ray/auth_token exists; this test has none)
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"})
    try:
        here = small_cfg(f"data.pretrain={corpus}", f"run.root={tmp_path / 'here'}")
        cluster = small_cfg(f"data.pretrain={corpus}", f"run.root={tmp_path / 'cluster'}",
                            f"tokenizer.cluster=127.0.0.1:{port}")
        with monkeypatch.context() as m:
            m.setattr(tokenize, "engine", this_process)
            outputs = [execute(here, "tokenize")]
        deadline = time.time() + 120
        while True:  # the head answers once its GCS is up
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline and head.poll() is None, "the Ray head did not start"
                time.sleep(0.5)
        outputs.append(execute(cluster, "tokenize"))
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(3)
        except subprocess.TimeoutExpired:  # (Ray takes half a minute to stop by itself)
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    assert outputs[0]["fingerprint"] == outputs[1]["fingerprint"]
    dirs = [locate(c, "tokenize")[0] for c in (here, cluster)]
    files = [sorted(f.name for f in (d / "shards").glob("*.bin")) for d in dirs]
    assert files[0] == files[1] and len(files[0]) >= 5
    for name in files[0]:
        assert (dirs[0] / "shards" / name).read_bytes() == (dirs[1] / "shards" / name).read_bytes(), name
    tokenizers = [(d / "tokenizer" / "tokenizer.json").read_bytes() for d in dirs]
    assert tokenizers[0] == tokenizers[1]
    # the head's own workers ran the units: the log of each worker of the stage's job (the cluster's first, 01000000)
    # names the tasks it ran; a stage that ignored tokenizer.cluster would leave no job on the head
    ran = [log.read_text() for log in (temp / "session_latest" / "logs").glob("worker-*-01000000-*.out")]
    shutil.rmtree(temp, ignore_errors=True)
    assert sum(text.count(":task_name:") for text in ran) >= 2 * 5, ran  # scan and encode, 5 units each


def test_a_cluster_nobody_answers_at_is_a_clear_error(small_cfg, tmp_path):
    path = tmp_path / "pipeline.yaml"
    path.write_text(dump_config(small_cfg(f"tokenizer.cluster=127.0.0.1:{free_port()}")))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "stage", "tokenize", "-c", str(path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1 and time.time() - t0 < 60
    assert proc.stderr.strip().splitlines()[-1].startswith("error: tokenizer.cluster=127.0.0.1:")
    assert "cannot reach a Ray cluster" in proc.stderr and "Traceback" not in proc.stderr


def test_chat_template_marks_assistant_tokens(small_cfg):
    cfg = small_cfg()
    manifest = execute(cfg, "tokenize")
    tok = AutoTokenizer.from_pretrained(
        f"{cfg.run.root}/store/tokenize/{manifest['fingerprint'][:16]}/tokenizer")
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tok.decode(marked) == "5<|im_end|>\n"


def test_a_number_is_one_token_wherever_it_stands():
    """Numbers are pre-tokenized apart from the space before them, so the answer of "Which is larger,
    89 or 3?" is the very token of the question's 89 (GPT-2's pre-tokenization makes it " 89" there)."""
    from gptforge.data.tokenizer import train_bpe

    texts = [f"Which is larger, {a} or {b}?\n{max(a, b)}" for a in range(100) for b in range(0, 100, 7)]
    tok = train_bpe(texts, 400, 2, ["<|endoftext|>"])
    question, answer = tok.encode("Which is larger, 89 or 3?"), tok.encode("89")
    assert len(answer.ids) == 1 and answer.ids[0] in question.ids
    assert tok.decode(question.ids) == "Which is larger, 89 or 3?"
    assert [w for w, _ in tok.pre_tokenizer.pre_tokenize_str("1234")] == ["123", "4"]  # 3 digits at most, as cl100k


def test_the_prefiltered_scan_keeps_the_exact_sample(small_cfg, tmp_path, monkeypatch):
    """Units return only documents below a fraction of the key range; the merged sample is still exactly the
    corpus's bottom-k sample (the reference: no pre-filter, as when unit sizes are unknown)."""
    from gptforge.data.corpus import Reading
    from gptforge.data.parallel import in_process
    from gptforge.data.sources import units

    for k in range(4):
        (tmp_path / f"p{k}.txt").write_text("".join(f"line {i} of file {k} " + "y" * (i % 50) + "\n"
                                                    for i in range(3000)))
    cfg = small_cfg(f"data.pretrain={tmp_path}/*.txt", "tokenizer.train_sample_bytes=40000")
    plan = units(cfg.data.pretrain)
    reading = Reading(cfg.data.pretrain, "text", cfg.data.demo)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    _, filtered = tokenize.scan(cfg, plan, reading, in_process, tmp_path / "a")
    monkeypatch.setattr(tokenize, "unit_bytes", lambda unit: None)
    _, reference = tokenize.scan(cfg, plan, reading, in_process, tmp_path / "b")
    assert filtered.texts() == reference.texts() and 39000 < filtered.size <= 40000


def test_a_pretrained_tokenizer_encodes_every_document_whole(small_cfg, corpus, tmp_path):
    """tokenizer.pretrained: a GPT-2-style byte-level BPE whose tokenizer.json carries truncation (as some on the hub
    do): the shards hold every document whole, in the tokenizer's own ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path, docs = corpus
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.enable_truncation(8)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(tmp_path / "gpt2-style")
    cfg = small_cfg(f"data.pretrain={path}", f"tokenizer.pretrained={tmp_path / 'gpt2-style'}")
    m = execute(cfg, "tokenize")["metrics"]
    out_dir = locate(cfg, "tokenize")[0]
    train, val = decode_split(out_dir, "train"), decode_split(out_dir, "val")
    assert sorted(train + val) == sorted(docs)
    tok.no_truncation()
    assert m["tokens"] == sum(len(e.ids) + 1 for e in tok.encode_batch(docs, add_special_tokens=False))
