"""Prompt split and label trie: the tokens fed to the model are exactly the whole prompt's tokens."""
import pytest
import torch

from tests.helpers import Lowering, random_queries
from tests.hf_reference import hf_scores
from prefixscore import Classifier, ConfigError, InputError
from prefixscore.labels import LabelTrie, check_labels
from prefixscore.prompt import Prompt

TEMPLATES = {
    "space": "Classify the query into a category. query: {query}",
    "colon": "Classify the query into a category. query:{query}",
    "newline": "Classify the query into a category.\n{query}",
    "none": "Classify the query into a categoryabc{query}",
    "trailing": "Classify: {query}\nAnswer:",
}
QUERIES = ["  leading spaces", "red dress 😀👗", "红色连衣裙 2024新款", "x" * 400,
           "abc", "Über jacket", "a b c d e f g", "\tindented", "'s", "—dash"]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_split_reproduces_whole_prompt_tokens(smol_tokenizer, name, chat):
    tok = smol_tokenizer
    p = Prompt(tok, TEMPLATES[name], chat=chat)
    for q in QUERIES + random_queries(30, seed=1):
        e = p.encode(query=q)
        whole = tok(e.text, add_special_tokens=not chat)["input_ids"]
        assert e.ids == whole
        assert e.text.count(q) >= 1
        if e.start:  # the cached prefix is literally the start of the whole prompt's tokens
            assert e.ids[: e.start] == p.prefix_ids
    assert len(p.prefix_ids) >= len(p.encode_text(p.prefix_text)) - 2  # at most a merge or two back
    assert p.backend is not None  # the ids above came from the Rust backend, checked against HF
    assert p.resume is not None  # ... tokenizing from the resume point, not the whole prompt


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("name", ["space", "colon", "newline", "trailing"])
def test_resume_point_fuzz(smol_tokenizer, name, chat):
    """Prompts tokenized from the resume point equal whole-prompt tokenization for queries built to
    reach back across it: leading whitespace and punctuation runs, digits, contractions, special
    token text, combining marks. special_tokens=True: whole-prompt tokenization parses the query's
    special-token text (the default tokenizes it as text: test_prompt_special.py)."""
    import random

    rng = random.Random(hash((name, chat)) & 0xFFFF)
    atoms = [" ", "  ", "\n", "\n\n", "\t", ":", "::", "(", ".", "!?", "'s", "'", "1", "2024", "a",
             "Abc", "é", "\u0301", "中", "😀", "<|im_end|>", "<|im_start|>", "_", "-", "—", "\r\n"]
    queries = ["".join(rng.choice(atoms) for _ in range(rng.randint(1, 6))) for _ in range(300)]
    queries = [q for q in queries if q.strip()]
    p = Prompt(smol_tokenizer, TEMPLATES[name], chat=chat, special_tokens=True)
    assert p.resume is not None
    got = [e.ids for e in p.encode_many([{"query": q} for q in queries])]
    assert got == [smol_tokenizer(p.render(query=q), add_special_tokens=not chat)["input_ids"]
                   for q in queries]


def test_resume_point_refused(smol_tokenizer):
    """A tokenizer that treats the start of any text specially (here: a Metaspace pre-tokenizer
    that prepends a word marker) fails the probe check: every prompt is tokenized whole."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer.from_str(smol_tokenizer.backend_tokenizer.to_str())
    inner.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(prepend_scheme="always"), inner.pre_tokenizer])
    tok = PreTrainedTokenizerFast(tokenizer_object=inner)
    p = Prompt(tok, TEMPLATES["colon"], chat=False)
    assert p.resume is None
    for q in QUERIES:
        assert p.encode(query=q).ids == tok(p.render(query=q))["input_ids"]


def test_batch_encoding_and_backend_fallback(smol_tokenizer):
    """encode_many (one batched backend call) equals encode one by one; a backend that disagrees
    with the HF call on the probes is not used."""
    p = Prompt(smol_tokenizer, TEMPLATES["colon"], chat=True)
    qs = QUERIES + random_queries(40, seed=2)
    assert [e.ids for e in p.encode_many([{"query": q} for q in qs])] == \
        [smol_tokenizer(p.render(query=q), add_special_tokens=False)["input_ids"] for q in qs]
    with pytest.raises(InputError) as err:
        p.encode_many([{"query": "ok"}, {"query": "fine"}, {"query": " "}])
    assert err.value.index == 2

    q = Prompt(Lowering(smol_tokenizer), TEMPLATES["colon"], chat=True)
    assert q.backend is None  # its backend disagrees with its own call: the call is kept
    assert q.encode(query="Red Dress").ids == \
        smol_tokenizer(q.render(query="Red Dress").lower(), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", ["space", "none", "trailing"])
def test_boundary_templates_match_hf(name, tiny_model):
    """End to end through the cached prefix: scores equal HF's on the full prompt."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("qwen2")
    clf = Classifier(str(path), TEMPLATES[name], ["Dress", "Jeans", "T-shirt", "Trench Coat"],
                     chat=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    res = clf.classify_batch(QUERIES)
    ref = hf_scores(hf, [clf.encode(q).ids for q in QUERIES], clf.trie)
    for r, s in zip(res, ref):
        assert max(abs(r.scores[l] - x) for l, x in zip(clf.labels, s)) < 1e-4


def test_exact_fallback_equals_cached(tiny_model):
    """A request whose tokens disagree with the cached prefix is computed without the cache; both
    paths must give the same answer for a request where either could be used."""
    clf = Classifier(str(tiny_model("llama")), chat=True)
    e = clf.encode("wool trench coat")
    assert e.start == clf.prefix_len > 0
    exact = type(e)(e.values, e.text, e.ids, 0)
    a, b = clf.classify_encoded([e])[0], clf.classify_encoded([exact])[0]
    assert a.label == b.label
    assert max(abs(a.scores[l] - b.scores[l]) for l in clf.labels) < 1e-4


def test_classify_iter_streams_in_input_order(tiny_model):
    """Batch by batch, in input order: a request without the cached prefix runs in a pass of its
    own, when the passes reach it (after the cached pass that holds the requests before it), so it
    holds back the results after it until then, never reorders them."""
    clf = Classifier(str(tiny_model("llama")), chat=True, max_batch_tokens=40)
    queries = [f"wool coat {i}" for i in range(12)]
    encoded = clf.encode_many(queries)
    e = encoded[5]
    encoded[5] = type(e)(e.values, e.text, e.ids, 0)  # computed without the cache
    batches = list(clf.classify_iter(encoded))
    assert len(batches) > 2 and [r.query for b in batches for r in b] == queries
    i = next(k for k, b in enumerate(batches) if b[0].query == queries[5])
    assert 0 < i < len(batches) - 1 and len(batches[i]) > 1, [[r.query for r in b] for b in batches]
    assert [r.scores for b in batches for r in b] == [r.scores for r in clf.classify_encoded(encoded)]


def test_shared_first_tokens_need_the_trie(smol_tokenizer):
    """T-shirt / Trench Coat share their first token in SmolLM2's tokenizer: one branching node."""
    p = Prompt(smol_tokenizer, "{query}", chat=True)
    trie = LabelTrie.build(smol_tokenizer, ["T-shirt", "Trench Coat", "Dress"], p.render(query="x"),
                           p.encode_text)
    assert trie.paths[0][0] == trie.paths[1][0]
    assert len(trie.nodes) == 2 and not trie.first_distinct


def test_label_that_prefixes_another_uses_eos(smol_tokenizer):
    p = Prompt(smol_tokenizer, "{query}", chat=True)
    trie = LabelTrie.build(smol_tokenizer, ["Coat", "Coat Rack"], p.render(query="x"), p.encode_text)
    eos = smol_tokenizer.eos_token_id
    assert trie.paths[0][-1] == eos and trie.paths[1][-1] == eos



@pytest.mark.parametrize("seed", range(6))
def test_assemble_one_is_assemble(seed):
    """The one-request assembly (plain Python) gives bitwise assemble()'s label scores and the same
    decision, on random tries: shared prefixes several tokens deep, labels that prefix others
    (EOS-terminated), up to 6 terms per label; scores as the label head leaves them."""
    import random

    rng = random.Random(seed)
    paths = {(rng.randrange(10, 30),)}
    n = rng.randint(3, 12)
    while len(paths) < n:  # a new label continues a random prefix of one already there
        p = rng.choice(sorted(paths))
        paths.add(p[:rng.randint(0, len(p))] + tuple(rng.randrange(10, 30) for _ in range(rng.randint(1, 3))))
    paths = sorted(paths)
    trie = LabelTrie([str(p) for p in paths], [list(p) for p in paths], eos_id=2)
    K, N, B = len(trie.nodes), len(trie.columns), 16
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * K, N, generator=g) * 4
    allowed = trie.allowed.repeat(B, 1)
    scores = logits.masked_fill(~allowed, float("-inf")).log_softmax(-1)
    best = scores.argmax(-1)
    many, decision = trie.assemble(scores, best, B)
    for i in range(B):
        one, d = trie.assemble_one(scores[i * K:(i + 1) * K], best[i * K:(i + 1) * K])
        assert one == many[i].tolist() and d == decision[i], (paths, i)
        # and both are right: each label's log-prob summed along its path, from the paths alone
        ref, greedy = [], []
        for p in trie.paths:
            at = [(trie.nodes.index(tuple(p[:j])), trie.columns.index(p[j])) for j in range(len(p))
                  if tuple(p[:j]) in trie.nodes]
            ref.append(sum(scores[i * K + n, c].item() for n, c in at))
            greedy.append(all(best[i * K + n].item() == c for n, c in at))
        assert one == pytest.approx(ref, abs=1e-5) and greedy.count(True) == 1 and greedy[d]
    assert max(len(t) for t in trie.terms) > 1  # some label sums several nodes' terms
    # a choice that follows no label (not a label head's output): both say label 0
    best = torch.randint(0, N, (B * K,), generator=g)
    decision = trie.assemble(scores, best, B)[1]
    assert [trie.assemble_one(scores[i * K:(i + 1) * K], best[i * K:(i + 1) * K])[1]
            for i in range(B)] == decision.tolist()


@pytest.mark.parametrize("labels,msg", [
    ([], "empty"), (["A", "A"], "duplicate"), (["A", ""], "non-empty"), ("A,B", "list"),
    (["A"], "at least two labels"),
])
def test_bad_labels(labels, msg):
    with pytest.raises(ConfigError, match=msg):
        Classifier(model="/nonexistent", labels=labels)


def test_one_label_is_only_refused_by_the_classifier():
    assert check_labels(["yes"]) == ["yes"]  # a Scorer may score one label token (SGLang scoring)


def test_bad_options():
    with pytest.raises(ConfigError, match="max_batch_tokens must be a positive integer, got '5'"):
        Classifier(model="/nonexistent", max_batch_tokens="5")


def test_template_over_the_context_limit(tiny_model):
    # max_position_embeddings = 512: the cached prefix alone is longer (was an IndexError in prefill)
    with pytest.raises(ConfigError, match=r"fixed part is \d+ tokens.*context limit of 512 tokens"):
        Classifier(str(tiny_model("mistral")), template="word " * 600 + "query: {query}", chat=False)


@pytest.mark.parametrize("template", ["no slot", "{query} and {query}", "{query} {other}", 42])
def test_bad_templates(template):
    with pytest.raises(ConfigError, match="slot|string"):
        Classifier(model="/nonexistent", template=template)


def test_bad_queries_and_context_limit(tiny_model):
    clf = Classifier(str(tiny_model("mistral")), chat=False)  # max_position_embeddings = 512
    with pytest.raises(InputError, match="empty"):
        clf.classify("   ")
    with pytest.raises(InputError, match="string"):
        clf.classify(None)
    with pytest.raises(InputError, match="list"):
        clf.classify_batch("not a list")
    with pytest.raises(InputError, match="^query 2: empty query"):  # 1-based, as the CLI says
        clf.classify_batch(["ok", "  "])
    with pytest.raises(InputError, match="^query 1: empty query"):
        clf.features(["  ", "ok"])
    long = "trench coat " * 400
    with pytest.raises(InputError, match=r"context limit of \d+ tokens"):
        clf.classify(long)
    clf.truncate = True
    r = clf.classify(long)
    assert r.label in clf.labels and len(r.query) < len(long)
    assert len(clf.encode(long).ids) <= clf.prompt.context_limit


def test_model_errors(tmp_path):
    from prefixscore import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist"):
        Classifier(model=str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="config.json"):
        Classifier(model=str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        Classifier(model=str(tmp_path))


def test_logits_mode(tiny_model):
    labels = ["Dress", "Jeans", "Other"]
    clf = Classifier(str(tiny_model("qwen3")), labels=labels, mode="logits")
    lp = Classifier(clf.loaded, labels=labels)
    for q in random_queries(20, seed=3):
        a, b = clf.classify(q), lp.classify(q)
        assert a.label == b.label  # single-token-distinct labels: argmax of logits = of log-probs
        assert a.label == max(labels, key=a.scores.get)
    with pytest.raises(ConfigError, match="first tokens"):
        Classifier(clf.loaded, labels=["T-shirt", "Trench Coat"], mode="logits")


LLAMA3_CHAT = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
               "{%- endif %}")


@pytest.mark.parametrize("template", ["Classify: {query}", "{query}", "{query}\nAnswer: ",
                                      "Classify the query:\n  {query}  \n", TEMPLATES["trailing"]])
def test_trimming_chat_template(smol_tokenizer, template):
    """A chat template that trims the message (Llama 3's `| trim`) keeps the slot, and trims a query
    at the message's edge as rendering the whole message does: ids equal HF's whole prompt."""
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = LLAMA3_CHAT
    p = Prompt(tok, template, chat=True)
    for q in ["red dress", "  red dress \n", "\tx\t", "a  b ", " 😀 ", "\n\nshirt"]:
        text = tok.apply_chat_template([{"role": "user", "content": template.replace("{query}", q)}],
                                       tokenize=False, add_generation_prompt=True)
        e = p.encode(query=q)
        assert e.text == text
        assert e.ids == tok(text, add_special_tokens=False)["input_ids"]


def test_trimming_chat_template_two_slots(smol_tokenizer):
    """The same for a multi-item template: the item at the message's end is trimmed, the query
    inside it is not."""
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = LLAMA3_CHAT
    template = "Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\n"
    p = Prompt(tok, template, chat=True, slots=("query", "item"))
    for q, it in [(" wool coat ", " parka \n"), ("x", "\ty")]:
        content = template.replace("{query}", q).replace("{item}", it)
        text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                       add_generation_prompt=True)
        assert p.render(query=q, item=it) == text


def test_switch_types_and_scorer_template_over_the_context_limit(tiny_model):
    """truncate="no" once turned truncation on; a scorer whose template fills the context crashed
    in the prefill's RoPE gather (IndexError) instead of saying why."""
    from prefixscore.scorer import Scorer

    model = tiny_model("llama")  # 512 positions
    for kw in ({"truncate": "no"}, {"chat": "yes"}):
        with pytest.raises(ConfigError, match="true or false"):
            Classifier(model, device="cpu", **kw)
    with pytest.raises(ConfigError, match="context limit of 512"):
        Scorer(model, "word " * 600 + "Query: {query}\nItem: {item}", device="cpu", chat=False)
