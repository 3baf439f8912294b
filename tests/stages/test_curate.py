"""The curate stage on a corpus the test plants: exact and near duplicates (at Jaccard similarities it measures),
evaluation items inside longer documents, low-quality documents, PII; 2 Ray workers, 4 tasks. Then curate,
tokenize and pretrain end to end, and a curate killed between its passes resumes to the same output."""

import gzip
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptforge.pipeline.store import execute, locate
from tests.helpers import config, run_stage

STOP = ["the", "of", "and", "to", "that", "with", "have", "be", "in", "for", "is", "on", "it", "as", "was"]
THRESHOLD = 0.7


def vocabulary(rng: random.Random, n: int = 3000) -> list[str]:
    return ["".join(rng.choices("abcdefghijklmnoprstuvw", k=rng.randint(3, 8))) for _ in range(n)]


def words(rng: random.Random, vocab: list[str], n: int) -> list[str]:
    return [rng.choice(STOP) if rng.random() < 0.35 else rng.choice(vocab) for _ in range(n)]


def text(ws: list[str]) -> str:
    """Sentences of ten words each."""
    return " ".join(" ".join(ws[i:i + 10]).capitalize() + "." for i in range(0, len(ws), 10))


def jaccard(a: str, b: str) -> float:
    """Exact Jaccard similarity of two documents' shingle sets, shingled as the stage's MinHash step shingles."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature

    sig = MinhashDedupSignature("/tmp/unused", MinhashConfig(n_grams=5))
    x, y = set(sig.get_shingles(a).ravel().tolist()), set(sig.get_shingles(b).ravel().tolist())
    return len(x & y) / len(x | y)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The corpus (4 JSONL files) and what the test knows of it: {id: kind}, the near-duplicate pairs with their
    Jaccard similarity, the evaluation items (data.eval)."""
    rng, root = random.Random(0), tmp_path_factory.mktemp("corpus")
    vocab = vocabulary(rng)
    docs: list[tuple[str, str]] = []  # (kind, text)
    base = [words(rng, vocab, 120) for _ in range(60)]
    docs += [("clean", text(ws)) for ws in base]
    docs += [("exact", text(base[i])) for i in range(10)]  # copies of clean 0-9
    pairs = []
    for i, share in [(10 + k, 0.01) for k in range(10)] + [(20 + k, 0.12) for k in range(10)]:
        ws = list(base[i])
        for j in rng.sample(range(len(ws)), max(1, int(share * len(ws)))):
            ws[j] = rng.choice(vocab)
        docs.append(("near", text(ws)))
        pairs.append((i, len(docs) - 1, jaccard(docs[i][1], docs[-1][1])))
    items = [text(words(rng, vocab, 16)) for _ in range(5)]
    for item in items:  # an evaluation item inside a longer document
        docs.append(("contaminated", text(words(rng, vocab, 60)) + " " + item + " " + text(words(rng, vocab, 60))))
    for _ in range(4):  # symbols: over Gopher's 0.1 hash-or-ellipsis a word
        ws = words(rng, vocab, 100)
        docs.append(("gopher_quality", text(ws[:70]) + " " + " ".join("#" + w for w in ws[70:])))
    for _ in range(4):  # the same line again and again: Gopher's repetition
        docs.append(("gopher_repetition", "\n".join([text(words(rng, vocab, 12))] * 12)))
    for k in range(3):
        docs.append(("pii", text(words(rng, vocab, 80)) + f" Write to jane.doe{k}@example.net or connect to "
                                                           f"8.8.{k}.8 today."))
    order = list(range(len(docs)))
    rng.shuffle(order)
    files = [root / f"part-{f}.jsonl" for f in range(4)]
    kinds = {}
    for n, i in enumerate(order):
        with open(files[n % 4], "a") as out:
            out.write(json.dumps({"text": docs[i][1], "n": i}) + "\n")
    for i, (kind, _) in enumerate(docs):
        kinds[i] = kind
    (root / "eval.jsonl").write_text("".join(json.dumps({"prompt": item.rsplit(" ", 4)[0],
                                                         "answer": item.rsplit(" ", 4)[1]}) + "\n" for item in items))
    return {"root": root, "docs": docs, "kinds": kinds, "pairs": pairs, "order": order}


def curate_config(root: Path, planted, *extra):
    return config(root, f"data.pretrain={planted['root']}/part-*.jsonl", f"data.eval={planted['root']}/eval.jsonl",
                  "curate.enabled=true", "tokenizer.num_workers=2",
                  "curate.filters={gopher_repetition: {}, gopher_quality: {}}",
                  f"curate.near_dedup.threshold={THRESHOLD}", *extra)


def read_documents(folder: Path) -> list[str]:
    out = []
    for shard in sorted(folder.glob("*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            out += [json.loads(line)["text"] for line in f]
    return out


@pytest.fixture(scope="module")
def curated(tmp_path_factory, planted):
    cfg, path = curate_config(tmp_path_factory.mktemp("curated"), planted)
    manifest = execute(cfg, "curate")
    return cfg, path, manifest, locate(cfg, "curate")[0]


def test_the_funnel_counts_each_planted_kind_and_near_duplicates_are_found_by_jaccard(planted, curated):
    _, _, manifest, out = curated
    m, kinds, docs = manifest["metrics"], planted["kinds"], planted["docs"]
    count = {k: sum(1 for v in kinds.values() if v == k) for k in set(kinds.values())}
    assert m["documents_in"] == len(docs) and m["bytes_in"] == sum(len(t.encode()) for _, t in docs)
    assert m["removed/exact_duplicate"] == count["exact"] == 10
    assert m["removed/contaminated"] == count["contaminated"] == 5
    assert m["removed/gopher_quality"] == 4 and m["removed/gopher_repetition"] == 4
    assert m["documents_kept"] == m["documents_in"] - sum(v for k, v in m.items() if k.startswith("removed/"))
    kept = read_documents(out / "documents")
    assert len(kept) == m["documents_kept"] and m["bytes_kept"] == sum(len(t.encode()) for t in kept)

    # near duplicates against the ground truth: a pair at or over the threshold loses one of its two documents
    removed = {json.loads(line)["text"] for shard in (out / "removed" / "near_duplicate").glob("*.gz")
               for line in gzip.open(shard, "rt")}
    truth = [(a, b) for a, b, j in planted["pairs"] if j >= THRESHOLD]
    assert 5 <= len(truth) < len(planted["pairs"])  # both sides of the threshold are planted
    found = [(a, b) for a, b in truth if docs[a][1] in removed or docs[b][1] in removed]
    right = [t for t in removed if any(t in (docs[a][1], docs[b][1]) for a, b in truth)]
    recall, precision = len(found) / len(truth), len(right) / len(removed)
    assert recall >= 0.9 and precision >= 0.95, (recall, precision, planted["pairs"])
    assert m["removed/near_duplicate"] == len(removed)

    # PII replaced; what was checked recorded; a few removed examples for the report
    pii = [t for t in kept if "Write to" in t]
    assert len(pii) == 3 and not any("@example.net" in t or "8.8.1.8" in t for t in pii)
    checked = json.loads((out / "decontamination.json").read_text())
    assert checked["data.eval"]["indexed"] == 5 and "data.sft held-out" in checked
    funnel = json.loads((out / "funnel.json").read_text())
    shown = funnel["examples"]["pretrain"]["contaminated"]
    assert len(shown) == 3 and shown[0]["contaminated_ngram"]


def test_the_report_shows_the_funnel_as_a_table_a_plot_and_examples(tmp_path, curated):
    from gptforge.pipeline.report import draw_funnel, funnel_markdown

    out, m = curated[3], curated[2]["metrics"]
    draw_funnel(m, tmp_path / "funnel.png")
    md = funnel_markdown(out, lambda name: f"plots/{name}.png")
    left = m["documents_in"] - m["removed/gopher_repetition"]
    assert (tmp_path / "funnel.png").stat().st_size > 1000 and "![curate-funnel](plots/curate-funnel.png)" in md
    assert f"| gopher_repetition | 4 | {left:,} |" in md and f"| near_duplicate | {m['removed/near_duplicate']} | " \
        f"{m['documents_kept']:,} |" in md
    assert "Removed as **contaminated**, for example:" in md


def test_curate_then_tokenize_then_pretrain(tmp_path, planted, curated):
    cfg, _, manifest, out = curated
    root = Path(cfg.run.root)
    cfg, path = curate_config(root, planted, "pretrain.max_steps=6", "pretrain.eval_every=3", "pretrain.save_every=3")
    assert locate(cfg, "curate")[0] == out  # the same curate output: pretraining settings do not change it
    tokenized = execute(cfg, "tokenize")
    assert tokenized["inputs"]["curate"]["fingerprint"] == manifest["fingerprint"]
    assert tokenized["metrics"]["documents"] == manifest["metrics"]["documents_kept"]
    pretrained, _, _ = run_stage(cfg, path, "pretrain")
    assert pretrained["metrics"]["global_step"] == 6 and pretrained["metrics"]["val_loss"] < 10


def test_a_killed_curate_resumes_with_its_finished_passes_kept(tmp_path, planted, curated):
    cfg, path = curate_config(tmp_path / "killed", planted)
    out = locate(cfg, "curate")[0]
    cmd = [sys.executable, "-m", "gptforge.stages.curate", "--config", str(path), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = out / "work" / "logs" / "filter" / "stats.json"
    deadline = time.monotonic() + 300
    while not first.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, f"the stage ended by itself (exit {proc.returncode}) before it was killed"
    os.killpg(proc.pid, signal.SIGKILL)  # after its first pass, before its last
    proc.wait()
    assert first.is_file() and not (out / "funnel.json").exists()
    done = {p.name: p.stat().st_mtime_ns for p in (out / "work" / "logs" / "filter" / "completions").iterdir()}
    assert len(done) == 4
    execute(cfg, "curate")
    again = {p.name: p.stat().st_mtime_ns for p in (out / "work" / "logs" / "filter" / "completions").iterdir()}
    assert again == done  # the finished tasks were kept, not run again
    assert read_documents(out / "documents") == read_documents(curated[3] / "documents")


def test_bad_curate_input_is_one_line_before_anything_runs(tmp_path, planted):
    cases = [
        (["curate.filters={gopher_qualty: {}}"], "curate.filters: unknown filter 'gopher_qualty'"),
        (["curate.near_dedup.threshold=1.5"], "curate.near_dedup.threshold: Input should be less than or equal to 1"),
        (["curate.decontaminate.extra=[/nonexistent/items.jsonl]"],
         "curate.decontaminate.extra: cannot read /nonexistent/items.jsonl"),
        (["curate.languages=[en]", "curate.language_model=/nonexistent/lid.176.bin"],
         "curate.language_model: /nonexistent/lid.176.bin is neither lingua nor a fastText model file"),
        (["curate.sources=[pretrain, sft]"], "curate.sources: data.sft is the demo"),
        (["data.sft.held_out=/nonexistent/held.jsonl"], "data.sft: held_out: file not found: /nonexistent/held.jsonl"),
    ]
    for overrides, line in cases:
        proc = subprocess.run([sys.executable, "-m", "gptforge.pipeline.cli", "run", "-c",
                               str(config(tmp_path, f"data.pretrain={planted['root']}/part-*.jsonl")[1]),
                               "--set", "curate.enabled=true", *[a for o in overrides for a in ("--set", o)]],
                              capture_output=True, text=True, cwd=tmp_path)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode in (1, 2) and line in last and last.startswith("error: "), proc.stderr[-2000:]
        assert not (tmp_path / "store" / "curate").exists()


def test_sft_and_preference_rows_are_curated_with_their_held_out_rows_kept_and_sft_trains_on_them(
        tmp_path, planted, pretrained, tokenized):
    """curate.sources [sft, preference]: the training rows lose their exact and near duplicates and the row holding a
    held-out row's text; PII is replaced; the held-out rows (every 20th) stay as they were; SFT trains on the rows
    kept, and tokenize (data.pretrain not curated) is the session's own, reused."""
    from gptforge.data import splits
    from gptforge.pipeline.store import upstream
    from tests.helpers import copy_store

    rng = random.Random(1)
    vocab = vocabulary(rng)

    def say(n=30):
        return text(words(rng, vocab, n))

    convs = [[say(12), say(30)] for _ in range(60)]  # (user, assistant); rows 0, 20 and 40 are held out
    convs[5], convs[7], convs[9] = list(convs[3]), list(convs[6]), list(convs[8])  # exact copies
    convs[14][1] = say(80)
    near = convs[14][1].split()
    near[40] = "zzzz"
    convs[15] = [convs[14][0], " ".join(near)]  # one word of 92 changed
    assert jaccard(" ".join(convs[14]), " ".join(convs[15])) > 0.85
    convs[11] = [say(12), say(10) + " " + convs[20][1] + " " + say(10)]  # a held-out answer inside a training row
    convs[13] = [say(12), say(20) + " Mail me at john.roe@example.org today."]
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u},
                                                    {"role": "assistant", "content": a}]}) + "\n" for u, a in convs))
    pairs = [{"prompt": say(12), "chosen": say(25), "rejected": say(25)} for _ in range(40)]
    pairs[7], pairs[9] = dict(pairs[6]), dict(pairs[8])
    preference = tmp_path / "preference.jsonl"
    preference.write_text("".join(json.dumps(p) + "\n" for p in pairs))

    cfg, path = config(tmp_path, f"data.sft={sft}", f"data.preference={preference}", "curate.enabled=true",
                       "curate.sources=[sft, preference]", "tokenizer.num_workers=2", "sft.max_steps=4",
                       "sft.on_too_long=truncate", "reward.policy_samples=0")
    assert "curate" in upstream(cfg, "sft") and "curate" in upstream(cfg, "reward")
    assert "curate" not in upstream(cfg, "tokenize")
    m = execute(cfg, "curate")["metrics"]
    out = locate(cfg, "curate")[0]
    assert (m["sft/documents_in"], m["sft/removed/exact_duplicate"], m["sft/removed/near_duplicate"],
            m["sft/removed/contaminated"], m["sft/documents_kept"]) == (57, 3, 1, 1, 52)
    assert (m["preference/documents_in"], m["preference/removed/exact_duplicate"],
            m["preference/documents_kept"]) == (38, 2, 36)
    assert "documents_in" not in m  # data.pretrain was not curated

    raw, read = splits.conversations(cfg.data), splits.conversations(splits.curated(cfg, {"curate": out}).data)
    assert read.val == raw.val and len(read.train) == 52
    gone = {5, 7, 9, 11, 15}  # the later copy of each duplicate, and the contaminated row
    assert [c["messages"][0]["content"] for c in read.train] == [u for i, (u, _) in enumerate(convs)
                                                                  if i % 20 and i not in gone]
    mailed = [c for c in read.train if "Mail me at" in c["messages"][1]["content"]]
    assert len(mailed) == 1 and "john.roe@example.org" not in mailed[0]["messages"][1]["content"]
    assert len(splits.preference_pairs(splits.curated(cfg, {"curate": out}).data).train) == 36

    copy_store(tokenized, tmp_path, "tokenize", "pretrain")
    _, _, output = run_stage(cfg, path, "sft")
    line = next(ln for ln in output.splitlines() if ln.startswith("[sft] ") and " val" in ln)
    used, skipped = re.match(r"\[sft\] (\d+) conversations .*skipped \{'too_long': (\d+)\}", line).groups()
    assert int(used) + int(skipped) == 52 and ", 3 val" in line, line  # the rows curate kept, no others


def test_lingua_keeps_the_languages_asked_for():
    from datatrove.data import Document

    from gptforge.data.curation.blocks import LinguaFilter

    keep = LinguaFilter(["en"], 0.5)
    assert keep.filter(Document(text="The weather is lovely today and we are going to the park.", id="1")) is True
    assert keep.filter(Document(text="Das Wetter ist heute schön und wir gehen in den Park.", id="2")) == \
        (False, "language")


def test_minhash_words_are_spacys_own_tokens():
    """SpanMemo (spaCy run once per distinct span) gives datatrove's spaCy tokens, on raw and simplified text."""
    from datatrove.pipeline.dedup.minhash import MinhashConfig
    from datatrove.utils.text import simplify_text
    from datatrove.utils.word_tokenizers import load_word_tokenizer

    from gptforge.data.curation.blocks import SpanMemo

    spacy, memo, rng = load_word_tokenizer("en"), SpanMemo(load_word_tokenizer("en")), random.Random(0)
    odd = ["can't", "cannot", "dont", "U.S.", "e.g.", "10km", "5pm", "3rd", "http://a.b/c?d=1", "o'clock", "gonna",
           ":)", "C++", "...", "naïve", "“quoted”", "50%", "$5", "x@y.com", "co-op", "  ", "\n", "\t"]
    chars = "abcdefghij0123456789.,;:!?'\"-()[]$%&*+/=<>@#~`^_|\\ "
    texts = [" ".join(rng.choice(odd + ["".join(rng.choices(chars, k=rng.randint(1, 8)))]) for _ in range(60))
             for _ in range(200)]
    norm = MinhashConfig().norm_config
    for t in texts + [simplify_text(t, norm) for t in texts]:
        assert memo.word_tokenize(t) == spacy.word_tokenize(t), t
