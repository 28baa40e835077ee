"""Multi-item scoring against Hugging Face transformers scoring each item alone with the whole prompt
(no cache, no packing): identical decisions, scores within 1e-4 (fp32), in every layout and mode."""
import json
import random
import string

import pytest
import torch

from tests.helpers import ARCHS, random_queries
from tests.hf_reference import _children, _left_pad, hf_generate
from prefixscore import ConfigError, InputError
from prefixscore.weights.loading import LoadedModel, load
from prefixscore.scorer import Scorer
from prefixscore.score_input import SOFT

TOL = 1e-4
LABELS = ["Dress", "T-shirt", "Trench Coat"]  # "T-shirt" / "Trench Coat" share a first token
TEMPLATES = {  # (template, chat)
    "query_first": ("Decide whether the item fits the query.\nQuery: {query}\nItem: {item}\nAnswer:", False),
    "glued": ("Match the query and the item:{query}{item}", False),  # item tokens merge into the query's
    "item_first": ("Rate the item for the query.\nItem: {item}\nQuery: {query}", False),
    "chat": ("Does the item fit the query?\nQuery: {query}\nItem: {item}", True),
}
WORDS = ["dress", "jeans", "shirt", "trench", "coat", "skirt", "tee", "hoodie", "knit", "women", "men",
         "blue", "red", "oversized", "vintage", "连衣裙", "牛仔裤", "卫衣", "2024新款", "size", "xl",
         "cotton", "😀", "summer", "¿", "camisa", "ジーンズ", "s", "'s", "ing", ",", "."]


def random_items(rng, n):
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            it = "".join(rng.choice(string.printable[:94]) for _ in range(rng.randint(1, 40)))
        elif r < 0.3:  # short, merge-prone: glue onto whatever precedes them
            it = rng.choice(["s", "'s", ".", "!", "ing", "-x", "123", "ed", "中"])
        else:
            it = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.1:
            it = " " + it
        out.append(it)
    return out


def random_requests(n, seed, most=8):
    rng = random.Random(seed)
    return [(q, random_items(rng, rng.randint(1, most))) for q in random_queries(n, seed)]


def whole_prompt(tok, template, chat, query, item):
    """The reference's own rendering: the template filled, in the chat template when asked."""
    text = template.format(query=query, item=item)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    return tok(text, add_special_tokens=not chat)["input_ids"]


@torch.no_grad()
def hf_trie(model, prompts, trie, batch=32, soft=None):
    """HF on each whole prompt (+ each maximal trie branch): per prompt the constrained log-prob of
    every label and the label-constrained greedy decision (at each node the child with the highest
    logit), from the same full-prompt logits. soft: per prompt None or a vector for its one SOFT
    (score_input.SOFT) token, passed as transformers' inputs_embeds."""
    kids = _children(trie)
    nodes = [n for n in trie.nodes if n]
    maximal = [n for n in nodes if not any(m != n and m[:len(n)] == n for m in nodes)] or [()]
    scores, decisions = [], []
    for b in range(0, len(prompts), batch):
        chunk = prompts[b:b + batch]
        ids, mask = _left_pad([p + list(n) for p in chunk for n in maximal], 0)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(n) for n in maximal) + 1  # only the last positions: not [batch, seq, vocab]
        feed = {"input_ids": ids}
        if soft is not None:
            at = ids == SOFT
            emb = model.get_input_embeddings()(ids.clamp(min=0))
            vecs = [soft[b + i] for i in range(len(chunk)) for _ in maximal]
            for r, v in enumerate(vecs):
                if v is not None:
                    emb[r, at[r]] = v.to(emb.dtype)
            feed = {"inputs_embeds": emb}
        logits = model(**feed, attention_mask=mask, position_ids=pos,
                       logits_to_keep=keep).logits.float()
        L = keep
        for i in range(len(chunk)):
            at = {}  # node -> logits after prompt + node
            for j, n in enumerate(maximal):
                for d in range(len(n) + 1):
                    at.setdefault(n[:d], logits[i * len(maximal) + j, L - len(n) - 1 + d])
            lp = {n: (at[n][k] - at[n][k].logsumexp(0)).tolist() for n, k in kids.items() if n in at}
            scores.append([sum(lp[tuple(p[:d])][kids[tuple(p[:d])].index(p[d])]
                               for d in range(len(p)) if len(kids[tuple(p[:d])]) > 1 or d == 0)
                           for p in trie.paths])
            node = ()
            while list(node) not in trie.paths:
                k = kids[node]
                node += (k[max(range(len(k)), key=lambda c: at[node][k[c]]) if len(k) > 1 else 0],)
            decisions.append(trie.paths.index(list(node)))
    return scores, decisions


@torch.no_grad()
def hf_last_logits(model, prompts, batch=32):
    out = []
    for b in range(0, len(prompts), batch):
        ids, mask = _left_pad(prompts[b:b + batch], 0)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out.append(model(input_ids=ids, attention_mask=mask, position_ids=pos,
                         logits_to_keep=1).logits[:, -1].float())
    return torch.cat(out)


@pytest.fixture(scope="module")
def models(tiny_model):
    """Per architecture: our loaded model (shared by every Scorer) and HF's on the same weights."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model(arch)
            cache[arch] = (load(path, "cpu", torch.float32),
                           AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), path)
        return cache[arch]

    return get


def check_against_hf(sc, hf, template, chat, requests, generate=0):
    """Every item of every request vs HF on its whole prompt: scores and decisions; the first
    `generate` items also against HF `generate` constrained to the label trie."""
    tok = sc.tokenizer
    results = sc.score_batch(requests)
    prompts = [whole_prompt(tok, template, chat, q, it) for q, items in requests for it in items]
    ours = [r for res in results for r in res]
    ref, greedy = hf_trie(hf, prompts, sc.trie)
    if generate:
        assert hf_generate(hf, prompts[:generate], sc.trie, tok.eos_token_id) == greedy[:generate]
    assert_matches_hf(sc, ours, ref, greedy, [f"item {r.item!r}" for r in ours])
    return ours


def assert_matches_hf(sc, ours, ref, greedy, names):
    """Our ItemResults against HF's per-label scores and decisions: decisions equal, scores within
    TOL. names: how a failure names each item."""
    worst = 0.0
    for r, s, g, name in zip(ours, ref, greedy, names, strict=True):
        assert r.label == sc.labels[g], f"decision differs from HF for {name}"
        worst = max(worst, max(abs(r.scores[l] - x) for l, x in zip(sc.labels, s)))
    assert worst < TOL, f"max |score - HF| = {worst:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_random_requests_match_hf(arch, models):
    """32 random requests per architecture (128 in all, 583 items), 1-8 items each of 1 to ~100
    tokens, over four templates (query first, glued slots, item first, chat) and the three
    layouts; 8 items per template also against HF `generate` constrained to the label trie."""
    loaded, hf, _ = models(arch)
    requests = random_requests(32, seed=ARCHS.index(arch))
    labels_seen = set()
    for k, (name, (template, chat)) in enumerate(TEMPLATES.items()):
        layout = ("packed", "alone", "auto")[(k + ARCHS.index(arch)) % 3]
        sc = Scorer(loaded, template, LABELS, chat=chat, layout=layout)
        ours = check_against_hf(sc, hf, template, chat, requests[k::4], generate=8)
        labels_seen |= {r.label for r in ours}
    assert len(labels_seen) > 1  # else a wrong argmax could hide


def test_layouts_share_the_query_part(models):
    """packed: one span holds the query part once and every item after it; alone: a copy per item;
    an item whose tokens merge across the slot boundary is computed alone, exactly."""
    loaded, hf, _ = models("qwen2")
    template = "Match the query and the item:{query}{item}"
    sc = Scorer(loaded, template, LABELS, chat=False, layout="packed")
    query, items = "blue summer dre", [" red", " cotton tee", "ss", " women xl"]
    prep = sc.prepare(query, items)
    groups = sc._groups(prep, branch=0, one_per_span=False)
    packed = [g for g in groups if len(g.tails) > 1]
    assert len(packed) == 1 and len(packed[0].shared) > 0  # the query part, once
    assert sum(len(g.tails) for g in groups) == 4
    # " dre" + "ss" tokenizes as " dress": that item cannot share the query's last token, so it
    # runs alone, from the cached prefix
    assert any(g.tails == [prep.full[2][g.start:]] and not g.shared for g in groups)
    for g in groups:  # every item's tokens are exactly its whole prompt's
        for tail, slot in zip(g.tails, g.slots):
            assert sc.prefix_ids[:g.start] + g.shared + tail == prep.full[slot]
    check_against_hf(sc, hf, template, False, [(query, items)])
    alone = Scorer(loaded, template, LABELS, chat=False, layout="alone")
    assert all(len(g.tails) == 1 for g in alone._groups(alone.prepare(query, items), 0, False))


def test_auto_layout_packs(models):
    """auto packs every item that fits behind one query part, on the CPU as on the GPU (both
    attentions scan an item's query part and own tokens, not the items between); alone gives each
    item its own span; the token budget closes a span."""
    loaded, _, _ = models("llama")
    sc = Scorer(loaded, TEMPLATES["query_first"][0], LABELS, chat=False, max_batch_tokens=2000)
    spans = sc.spans
    for shared, sizes in [(50, [150] * 100), (200, [5] * 50), (0, [40] * 50), (7, [3, 90, 12] * 9)]:
        assert spans.items_per_span(shared, sizes) == len(sizes)
        chunks = spans.fill(shared, sizes, len(sizes))
        assert [j for c in chunks for j in c] == list(range(len(sizes)))
        assert all(shared + sum(sizes[j] for j in c) <= 2000 or len(c) == 1 for c in chunks)
    assert len(spans.fill(50, [150] * 100, 100)) == 8  # 12 items of 150 fit 2000 behind 50
    assert Scorer(loaded, TEMPLATES["query_first"][0], LABELS, chat=False,
                  layout="alone").spans.items_per_span(200, [5] * 50) == 1
    # item first: only the pinned prefix is shared, so every item is its own span
    first = Scorer(loaded, TEMPLATES["item_first"][0], LABELS, chat=False, layout="packed")
    assert first.item_first
    prep = first.prepare("a query", ["one", "two items"])
    assert all(not g.shared for g in first._groups(prep, 0, False))


def test_modes_match_hf(models):
    """softmax = exp(constrained log-probs); logits = raw first-token logits; vocab_probs = the label
    tokens' probabilities under the full vocabulary (SGLang apply_softmax=false)."""
    loaded, hf, _ = models("qwen3")
    template, chat = TEMPLATES["query_first"]
    requests = random_requests(6, seed=11)
    labels = [" yes", " no", " maybe"]
    for mode in ("softmax", "logits", "vocab_probs"):
        sc = Scorer(loaded, template, labels, chat=chat, mode=mode)
        assert all(len(p) == 1 for p in sc.trie.paths)
        ours = [r for res in sc.score_batch(requests) for r in res]
        prompts = [whole_prompt(sc.tokenizer, template, chat, q, it) for q, its in requests for it in its]
        logits = hf_last_logits(hf, prompts)
        cols = [p[0] for p in sc.trie.paths]
        ref = {"softmax": logits[:, cols].softmax(-1), "logits": logits[:, cols],
               "vocab_probs": logits.softmax(-1)[:, cols]}[mode]
        got = torch.tensor([[r.scores[l] for l in labels] for r in ours])
        assert (got - ref).abs().max() < TOL, mode
        assert [r.label for r in ours] == [labels[i] for i in ref.argmax(-1).tolist()]
        if mode == "softmax":
            assert torch.allclose(got.sum(-1), torch.ones(len(ours)), atol=1e-5)


def test_labels_that_branch_twice(models):
    """Several branching trie nodes: packed spans cannot hold them, so auto scores items alone."""
    loaded, hf, _ = models("mistral")
    template, chat = TEMPLATES["query_first"]
    labels = ["T-shirt", "Trench Coat", "Knitwear", "Knit cap", "Dress"]
    sc = Scorer(loaded, template, labels, chat=chat)
    assert len(sc.trie.branch_paths()) > 1
    check_against_hf(sc, hf, template, chat, random_requests(4, seed=5))
    with pytest.raises(ConfigError, match="layout 'alone'"):
        Scorer(loaded, template, labels, chat=chat, layout="packed")


def test_batch_equals_single(models):
    loaded, _, _ = models("qwen2")
    sc = Scorer(loaded, TEMPLATES["query_first"][0], LABELS, chat=False)
    requests = random_requests(5, seed=3)
    together = sc.score_batch(requests)
    for (q, items), res in zip(requests, together):
        alone = sc.score(q, items)
        assert [r.label for r in alone] == [r.label for r in res]
        for a, b in zip(alone, res):
            assert max(abs(a.scores[l] - b.scores[l]) for l in LABELS) < 1e-5


def test_score_to_a_depth(models):
    """Scorer.score(depth=): the first items scored as without it, the rest in place and unscored;
    a DepthControl gives the depth and is told the call's latency; a bad depth is a ConfigError."""
    from prefixscore.depth import DepthControl, DepthOptions

    loaded, _, _ = models("qwen2")
    sc = Scorer(loaded, TEMPLATES["query_first"][0], LABELS, chat=False)
    q, items = random_requests(1, seed=5, most=8)[0]
    items = (items * 3)[:6]
    whole = sc.score(q, items)
    cut = sc.score(q, items, depth=4)
    assert [r.scored for r in cut] == [True] * 4 + [False] * 2
    assert [r.item for r in cut] == items and all(r.label is None and not r.scores for r in cut[4:])
    for a, b in zip(cut[:4], whole):
        assert a.label == b.label and max(abs(a.scores[l] - b.scores[l]) for l in LABELS) < 1e-5
    control = DepthControl(DepthOptions(target_p99_ms=1e4, min_depth=1, max_depth=3))
    assert sum(r.scored for r in sc.score(q, items, depth=control)) == 3
    assert len(control._samples) == 1  # told the latency
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="depth"):
            sc.score(q, items, depth=bad)


def test_score_request_sglang_shape(models):
    """SGLang /v1/score: label_token_ids or single-token labels, apply_softmax, item_first, text or
    token ids; scores per item in label order. Text follows the template's slot order; token ids
    are scored as given (query + item, or item + query)."""
    loaded, hf, _ = models("llama")
    tok = loaded.tokenizer
    yes, no = tok(" yes")["input_ids"][-1], tok(" no")["input_ids"][-1]
    query, items = "wool coat", [" a long camel coat", " flip flops", "s"]
    for name in ("query_first", "item_first"):
        template = TEMPLATES[name][0]
        sc = Scorer(loaded, template, LABELS, chat=False)
        prompts = [whole_prompt(tok, template, False, query, it) for it in items]
        logits = hf_last_logits(hf, prompts)
        for apply_softmax in (True, False):
            resp = sc.score_request({"query": query, "items": items, "label_token_ids": [yes, no],
                                     "apply_softmax": apply_softmax, "item_first": name == "item_first"})
            ref = logits[:, [yes, no]].softmax(-1) if apply_softmax else logits.softmax(-1)[:, [yes, no]]
            assert torch.tensor(resp["scores"]).sub(ref).abs().max() < TOL
            assert resp["object"] == "scoring" and resp["labels"] == tok.convert_ids_to_tokens([yes, no])
        with pytest.raises(InputError, match="the template decides where each slot goes"):
            sc.score_request({"query": query, "items": items, "label_token_ids": [yes, no],
                              "item_first": name != "item_first"})
    # single-token text labels, one bare item (SGLang allows it); omitted item_first = the template's
    resp = sc.score_request({"query": query, "items": items[0], "labels": [" yes", " no"],
                             "apply_softmax": True})
    assert len(resp["scores"]) == 1 and abs(sum(resp["scores"][0]) - 1) < 1e-5
    q_ids, i_ids = tok("wool coat")["input_ids"], [tok(it)["input_ids"] for it in items]
    for item_first in (False, True):
        resp = sc.score_request({"query": q_ids, "items": i_ids, "label_token_ids": [yes, no],
                                 "item_first": item_first})
        seqs = [i + q_ids if item_first else q_ids + i for i in i_ids]
        ref = hf_last_logits(hf, seqs).softmax(-1)[:, [yes, no]]
        assert torch.tensor(resp["scores"]).sub(ref).abs().max() < TOL


def test_request_label_sets_bounded(models, tmp_path, smol_tokenizer):
    """Label sets named by requests live in a small LRU (memory stays bounded however requests vary
    them); the scorer's own stays, and so do its graphs' weights. Ids of a padded vocabulary (rows
    past the tokenizer's last token, as in Qwen) are named by their number."""
    from tests.helpers import make_tiny_model

    from prefixscore import scorer as scorer_mod

    loaded, _, _ = models("llama")
    sc = Scorer(loaded, TEMPLATES["query_first"][0], LABELS, chat=False)
    own = sc.head
    for i in range(3 * scorer_mod.REQUEST_HEADS):
        sc.score_request({"query": "q", "items": ["a"], "label_token_ids": [100 + i, 200 + i]})
    assert len(sc._heads) == scorer_mod.REQUEST_HEADS and sc.head is own
    assert sc._head(LABELS, None) is own
    padded = load(make_tiny_model(tmp_path / "padded", "llama", smol_tokenizer,
                                  vocab_size=len(smol_tokenizer) + 128), "cpu", torch.float32)
    sp = Scorer(padded, TEMPLATES["query_first"][0], LABELS, chat=False)
    past = len(smol_tokenizer) + 5
    resp = sp.score_request({"query": "q", "items": ["a"], "label_token_ids": [past, 9]})
    assert resp["labels"] == [str(past), smol_tokenizer.convert_ids_to_tokens(9)]
    assert len(resp["scores"][0]) == 2


def test_token_ids_without_tokenizer(models):
    """A weights-only model (no tokenizer) scores token ids; sequences that start with the pinned
    prefix reuse it, the others are computed without it."""
    loaded, hf, _ = models("qwen3")
    bare = LoadedModel(loaded.model, loaded.lm_head, None, "weights only")
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(12)]
    sc = Scorer(bare, label_token_ids=[300, 301, 302], prefix_ids=prefix, mode="logprobs")
    query = prefix + [rng.randrange(100, 40000) for _ in range(9)]
    items = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 20))] for _ in range(7)]
    for q in (query, query[3:]):  # with and without the pinned prefix
        res = sc.score_ids(q, items)
        ref = hf_last_logits(hf, [q + it for it in items])[:, [300, 301, 302]].log_softmax(-1)
        got = torch.tensor([list(r.scores.values()) for r in res])
        assert (got - ref).abs().max() < TOL
    with pytest.raises(ConfigError, match="no tokenizer"):
        Scorer(bare, "{query}{item}", label_token_ids=[1])


def test_bad_input(models):
    loaded, _, _ = models("qwen2")
    template = TEMPLATES["query_first"][0]
    sc = Scorer(loaded, template, LABELS, chat=False, max_items=5)
    with pytest.raises(InputError, match="no items"):
        sc.score("red dress", [])
    with pytest.raises(InputError, match=r"items\[1\] is empty"):
        sc.score("red dress", ["ok", ""])
    with pytest.raises(InputError, match=r"items\[0\] is empty"):
        sc.score("red dress", ["  \n"])
    with pytest.raises(InputError, match=r"items\[0\] must be a string"):
        sc.score("red dress", [3])
    with pytest.raises(InputError, match="list of strings"):
        sc.score("red dress", "one item, not a list")
    with pytest.raises(InputError, match="empty query"):
        sc.score(" ", ["x"])
    with pytest.raises(InputError, match=r"items\[1\].*over the model's context limit of \d+"):
        sc.score("red dress", ["fine", "dress " * 600])
    with pytest.raises(InputError, match="6 items in one request, over the limit of 5"):
        sc.score("red dress", ["a"] * 6)
    with pytest.raises(InputError, match="request 2: no items"):
        sc.score_batch([("q", ["a"]), ("q", [])])
    # score requests: labels must be single tokens (scores are per label token, like label_token_ids)
    with pytest.raises(InputError, match="'Trench Coat' is \\d+ tokens"):
        sc.score_request({"query": "q", "items": ["a"], "labels": ["Trench Coat", "Dress"]})
    with pytest.raises(InputError, match="labels or label_token_ids, not both"):
        sc.score_request({"query": "q", "items": ["a"], "labels": ["Dress"], "label_token_ids": [5]})
    with pytest.raises(InputError, match="not a token id of this model"):
        sc.score_request({"query": "q", "items": ["a"], "label_token_ids": [10 ** 9]})
    with pytest.raises(InputError, match="duplicates"):
        sc.score_request({"query": "q", "items": ["a"], "label_token_ids": [5, 5]})
    with pytest.raises(InputError, match="apply_softmax must be true or false"):
        sc.score_request({"query": "q", "items": ["a"], "apply_softmax": "yes"})
    with pytest.raises(InputError, match="need single-token labels, and 'Dress' is 2 tokens"):
        sc.score_request({"query": "q", "items": ["a"]})
    with pytest.raises(InputError, match="no items"):
        sc.score_request({"query": "q", "items": [], "label_token_ids": [5]})
    with pytest.raises(ConfigError, match="slot \\{item\\}"):
        Scorer(loaded, "only {query}", LABELS)
    with pytest.raises(ConfigError, match="first tokens differ"):
        Scorer(loaded, template, LABELS, chat=False, mode="logits")
    with pytest.raises(ConfigError, match="unknown layout"):
        Scorer(loaded, template, LABELS, chat=False, layout="diagonal")


def test_cli_score(models, tmp_path, capsys):
    from prefixscore.cli.commands import main

    _, _, path = models("qwen2")
    template = TEMPLATES["query_first"][0]
    src = tmp_path / "req.jsonl"
    reqs = [{"id": 7, "query": "red dress", "items": ["red silk dress", "jeans"]},
            {"id": 8, "query": "hoodie", "items": ["grey hoodie xl"]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    out = tmp_path / "out.jsonl"
    args = ["score", "-i", str(src), "-o", str(out), "--model", str(path), "--device", "cpu",
            "--template", template, "--no-chat", "--labels", "Dress,Jeans", "--mode", "softmax"]
    assert main(args) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [7, 8] and lines[0]["labels"] == ["Dress", "Jeans"]
    assert len(lines[0]["scores"]) == 2 and all(abs(sum(s) - 1) < 1e-5 for s in lines[0]["scores"])
    sc = Scorer(str(path), template, ["Dress", "Jeans"], chat=False, mode="softmax", device="cpu")
    assert lines[1]["best"] == [r.label for r in sc.score("hoodie", ["grey hoodie xl"])]
    src.write_text(json.dumps(reqs[0]) + "\n" + json.dumps({"query": "x", "items": ["ok", ""]}) + "\n")
    assert main(args) == 2
    assert f"{src}:2: items[1] is empty" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_matches_hf(tiny_model):
    """The same 128 random requests on the GPU in bf16 against HF on the same weights. bf16 has no
    single right answer, so the yardstick is HF fp32: our bf16 scores may be at most twice as far
    from it as HF's own bf16 scores are (and 2e-2 always passes); decisions equal HF fp32's
    wherever its top two labels are further apart than that bound."""
    from transformers import AutoModelForCausalLM

    for arch in ARCHS:
        path = tiny_model(arch)
        loaded = load(path, "cuda", torch.bfloat16)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
        template, chat = TEMPLATES["query_first"]
        requests = random_requests(32, seed=ARCHS.index(arch))
        for layout in ("packed", "alone"):
            sc = Scorer(loaded, template, [" yes", " no", " maybe"], chat=chat, layout=layout,
                        mode="softmax")
            ours = [r for res in sc.score_batch(requests) for r in res]
            prompts = [whole_prompt(sc.tokenizer, template, chat, q, it) for q, its in requests
                       for it in its]
            cols = [p[0] for p in sc.trie.paths]
            refs = {}
            with torch.no_grad():
                for dtype in (torch.float32, torch.bfloat16):
                    hf.to(dtype)
                    logits = []
                    for b in range(0, len(prompts), 32):
                        ids, mask = _left_pad(prompts[b:b + 32], 0)
                        pos = (mask.cumsum(-1) - 1).clamp(min=0)
                        out = hf(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                                 position_ids=pos.cuda(), logits_to_keep=1)
                        logits.append(out.logits[:, -1, cols].float().cpu())
                    refs[dtype] = torch.cat(logits).softmax(-1)
                hf.to(torch.float32)
            ref = refs[torch.float32]
            got = torch.tensor([[r.scores[l] for l in sc.labels] for r in ours])
            bound = max(2e-2, 2 * (refs[torch.bfloat16] - ref).abs().max().item())
            assert (got - ref).abs().max() < bound, (arch, layout, bound)
            top2 = ref.topk(2, -1).values
            clear = (top2[:, 0] - top2[:, 1]) > bound
            assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear]), (arch, layout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pdl_changes_nothing(tiny_model, monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py) only overlaps a kernel's start (and its
    early weight loads) with the kernel ahead: scores through the captured graphs are bitwise
    those of plain launches. (One engine per setting: an engine's KernelOptions are fixed; a
    Scorer over a loaded model takes the engine made for it first.)"""
    from prefixscore.engine import Engine
    from prefixscore.kernels import pdl

    template, chat = TEMPLATES["query_first"]
    requests = random_requests(48, seed=11)
    out = {}
    for on in (True, False):
        loaded = load(tiny_model("qwen2"), "cuda", torch.bfloat16)
        engine = Engine.shared(loaded, pdl=on)
        if torch.cuda.get_device_capability()[0] >= 9:
            assert pdl.enabled(torch.device("cuda"), engine.options) == on
        sc = Scorer(loaded, template, [" yes", " no", " maybe"], chat=chat, mode="softmax")
        assert sc.engine is engine
        out[on] = [[r.scores for r in res] for res in sc.score_batch(requests)]
    assert out[True] == out[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_early_weights_and_trigger(tiny_model, monkeypatch):
    """Weight tiles loaded before the PDL wait and the early trigger (kernels/pdl.py): the trigger
    only moves the next launch, so scores are bitwise those without it; the early loads feed one
    dot over PRE K-steps instead of PRE dots, so scores stay within bf16 rounding (0.02) of the
    plain path, with the same decisions."""
    from prefixscore.engine import Engine

    template, chat = TEMPLATES["query_first"]
    requests = random_requests(48, seed=12)
    out = {}
    for early, trig, at_wait in ((True, True, 0), (True, True, 1), (True, True, 2), (True, True, 3),
                                 (True, False, 0), (False, False, 0)):
        loaded = load(tiny_model("qwen2"), "cuda", torch.bfloat16)
        # at_wait: which kernels trigger at their wait
        engine = Engine.shared(loaded, early_weights=early, trigger=trig, trigger_at_wait=at_wait)
        sc = Scorer(loaded, template, [" yes", " no", " maybe"], chat=chat, mode="softmax")
        assert sc.engine is engine
        res = [torch.tensor([list(r.scores.values()) for r in res]) for res in sc.score_batch(requests)]
        out[early, trig] = out.get((early, trig)) or res
        for a, b in zip(out[early, trig], res):
            assert torch.equal(a, b)
    for a, b in zip(out[True, True], out[True, False]):
        assert torch.equal(a, b)
    for a, b in zip(out[True, True], out[False, False]):
        assert (a - b).abs().max() <= 0.02
        top2 = b.topk(2, dim=1).values
        near_tie = top2[:, 0] - top2[:, 1] < 0.04  # only these may change their decision
        assert ((a.argmax(1) == b.argmax(1)) | near_tie).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_large_passes_pruned(tiny_model, monkeypatch):
    """Eager passes past the skinny kernels (graphs only up to 64 tokens here) with the last layer
    for the read-out rows only, against the plain path: within bf16 rounding (0.02) of its
    scores, decisions equal but near ties."""
    from prefixscore import engine

    template, chat = TEMPLATES["query_first"]
    requests = random_requests(48, seed=13)
    monkeypatch.setattr(engine, "GRAPH_MAX_TOKENS", 64)
    out = {}
    arms = {"plain": dict(prune_last_layer=False), "pruned": {}}
    for name, changes in arms.items():
        loaded = load(tiny_model("qwen2"), "cuda", torch.bfloat16)
        engine.Engine.shared(loaded, **changes)
        sc = Scorer(loaded, template, [" yes", " no", " maybe"], chat=chat, mode="softmax")
        out[name] = [torch.tensor([list(r.scores.values()) for r in res]) for res in sc.score_batch(requests)]
    for name in arms:
        for a, b in zip(out[name], out["plain"]):
            assert (a - b).abs().max() <= 0.02, name
            top2 = b.topk(2, dim=1).values
            near_tie = top2[:, 0] - top2[:, 1] < 0.04
            assert ((a.argmax(1) == b.argmax(1)) | near_tie).all(), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_vocab_probs_from_graphs(tiny_model, monkeypatch):
    """SGLang's default mode (apply_softmax false: each label token's probability under the whole
    vocabulary) replays a vocabulary graph for any label set, the scorer's own or a request's,
    against the eager path (graphs=False): log-probabilities within 0.1 (logits in bf16, of size
    <= ~20, round by <= 0.04 each on either path, their log-sum-exp likewise), and staged passes
    back to back give each pass's own answer."""
    import numpy as np

    from prefixscore.graphs import GraphRunner

    template, chat = TEMPLATES["query_first"]
    requests = random_requests(12, seed=21)
    loaded = load(tiny_model("qwen2"), "cuda", torch.bfloat16)
    graphs = Scorer(loaded, template, [" yes", " no"], chat=chat, mode="softmax")
    eager = Scorer(loaded, template, [" yes", " no"], chat=chat, mode="softmax", graphs=False)
    replays = []
    launch = GraphRunner.launch
    monkeypatch.setattr(GraphRunner, "launch", lambda self, *a: replays.append(self.vocab) or launch(self, *a))
    for ids in (None, [5, 9, 11, 300]):
        for q, items in requests:
            body = {"query": q, "items": items}
            if ids:
                body["label_token_ids"] = ids
            a = np.log(np.asarray(graphs.score_request(body)["scores"]))
            b = np.log(np.asarray(eager.score_request(body)["scores"]))
            assert np.abs(a - b).max() <= 0.1, (q, np.abs(a - b).max())
    assert set(replays) == {64} and len(replays) >= 2 * len(requests)  # all from vocabulary graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_copies_change_nothing(tiny_model, monkeypatch):
    """The small buckets' graphs copy their input in and their output out themselves
    (KernelOptions.graph_copies): scores are bitwise those of copies around the replay, for calls in a
    bucket with the copies inside and one without, back to back (a replay must read this call's
    input, not the last one's)."""
    from prefixscore import engine, graphs

    template, chat = TEMPLATES["query_first"]
    requests = random_requests(24, seed=12)
    monkeypatch.setattr(graphs, "GRAPH_COPY_MAX_BYTES", 4096)  # bucket 16 inside, the rest not
    out = {}
    for on in (True, False):
        loaded = load(tiny_model("qwen2"), "cuda", torch.bfloat16)
        engine.Engine.shared(loaded, graph_copies=on)
        sc = Scorer(loaded, template, [" yes", " no", " maybe"], chat=chat, mode="softmax")
        assert sc.capture_info["capture_s"] > 0 and sc.capture_info["graph_mem_mb"] >= 0
        inline = [v for r in sc.engine.graphs.values() for v in r.inline.values()]
        assert (True in inline and False in inline) if on else not any(inline)
        out[on] = [[r.scores for r in res] for q in requests[:6] for res in sc.score_batch([(q[0], q[1][:1])])]
        out[on] += [[r.scores for r in res] for res in sc.score_batch(requests)]
    assert out[True] == out[False]

