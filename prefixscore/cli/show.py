"""What a Classifier shows the model for one query, as text (`--show-prompt`): the rendered prompt,
where it is split between the pinned prefix (computed once and cached) and the suffix each query
runs, and the label tokens the scores are read at (the label trie)."""
from __future__ import annotations


def pieces(tokenizer, ids: list[int]) -> str:
    """Each token's text, quoted, so spaces, newlines and partial characters show."""
    return " ".join(repr(tokenizer.decode([i])) for i in ids)


def describe(clf, query: str) -> str:
    tok, prompt = clf.loaded.tokenizer, clf.prompt
    e = clf.encode(query)
    prefix = prompt.prefix_ids
    suffix = e.ids[e.start:]
    source = ("the adapter's" if clf.adapter_meta else "the seed prompt" if _is_seed(prompt.template)
              else "given")
    out = [f"model {clf.loaded.name}; template: {source}; chat template: {'on' if prompt.chat else 'off'}; "
           f"mode {clf.mode}",
           f"prompt for the query {e.values['query']!r}:", "<<<", e.text, ">>>"]
    if e.start:
        out.append(f"tokens: {len(e.ids)} = {len(prefix)} pinned prefix (computed once and cached) "
                   f"+ {len(suffix)} suffix (computed per query)")
    else:  # its first tokens merge with the prompt's: no cached prefix to start from
        out.append(f"tokens: {len(e.ids)}, all computed for this query: its text merges with the "
                   f"prompt before it, so the pinned prefix ({len(prefix)} tokens) does not apply")
    out += [f"pinned prefix ({len(prefix)} tokens) ids: {prefix}",
            f"pinned prefix pieces: {pieces(tok, prefix)}",
            f"suffix ({len(suffix)} tokens) ids: {suffix}",
            f"suffix pieces: {pieces(tok, suffix)}"]
    if clf.head is not None:
        out.append(f"labels ({len(clf.labels)}): decided by a trained {clf.head.kind} head on the "
                   f"hidden state after the suffix; no label tokens are scored")
        out += [f"  {l}" for l in clf.labels]
        return "\n".join(out)
    trie = clf.trie
    out.append(f"labels ({len(clf.labels)}), each as its tokens follow the prompt:")
    w = max(len(l) for l in clf.labels) + 2
    for label, path in zip(clf.labels, trie.paths):
        out.append(f"  {label.ljust(w)}{path}  {pieces(tok, path)}")
    branches = trie.branch_paths()
    how = ("the first token's logit" if clf.mode == "logits" else
           "the log-softmax over each node's children, summed along the label's path")
    out.append(f"label trie: {len(trie.nodes)} scored node(s) ({how}): the root (the first label "
               f"token, read after the suffix)" + (f" and {len(branches)} branching node(s), whose "
                                                   f"paths run after the suffix in the same pass:"
                                                   if branches and clf.mode == "logprobs" else ""))
    if clf.mode == "logprobs":
        for path in branches:
            kids = sorted({p[len(path)] for p in trie.paths if tuple(p[:len(path)]) == path})
            out.append(f"  after {pieces(tok, list(path))}: {' | '.join(pieces(tok, [k]) for k in kids)}")
    return "\n".join(out)


def _is_seed(template: str) -> bool:
    from ..prompt import SEED_TEMPLATE

    return template == SEED_TEMPLATE
