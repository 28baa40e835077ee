"""The slow reference: Hugging Face transformers on the full prompt, no cache.

scores:   one full-prompt forward per distinct branch path; restricted log-softmax at each trie node.
decision: `generate` at temperature 0 with the allowed tokens restricted to the trie.
"""
from __future__ import annotations

import torch


def _children(trie):
    kids = {}
    for p in trie.paths:
        for d in range(len(p)):
            k = kids.setdefault(tuple(p[:d]), [])
            if p[d] not in k:
                k.append(p[d])
    return kids


def _left_pad(seqs, pad):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, L - len(s):] = torch.tensor(s)
        mask[i, L - len(s):] = 1
    return ids, mask


@torch.no_grad()
def hf_scores(model, prompts: list[list[int]], trie, batch=16):
    """Per prompt: {label index: log-prob under label-constrained decoding} computed from full logits."""
    kids = _children(trie)
    # Sequences: prompt + each maximal scored node path (covers the root and all its ancestors).
    nodes = [n for n in trie.nodes if n]
    maximal = [n for n in nodes if not any(m != n and m[: len(n)] == n for m in nodes)] or [()]
    out = []
    for b0 in range(0, len(prompts), batch):
        chunk = prompts[b0:b0 + batch]
        seqs = [p + list(n) for p in chunk for n in maximal]
        ids, mask = _left_pad(seqs, 0)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        keep = max(len(n) for n in maximal) + 1  # only the last positions feed label scores
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       logits_to_keep=keep).logits.float()
        for qi, p in enumerate(chunk):
            node_logits = {}
            for mi, n in enumerate(maximal):
                row = logits[qi * len(maximal) + mi]
                for d in range(len(n) + 1):  # logits after prompt + n[:d]
                    node_logits.setdefault(n[:d], row[keep - len(n) - 1 + d])
            res = []
            for path in trie.paths:
                s = 0.0
                for d in range(len(path)):
                    node = tuple(path[:d])
                    if len(kids[node]) > 1 or d == 0:
                        lg = node_logits[node][kids[node]]
                        s += (lg - torch.logsumexp(lg, 0))[kids[node].index(path[d])].item()
                res.append(s)
            out.append(res)
    return out


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], trie, eos_id, batch=16):
    """Decision index per prompt via model.generate restricted to the trie (greedy)."""
    kids = _children(trie)
    out = []
    for b0 in range(0, len(prompts), batch):
        chunk = prompts[b0:b0 + batch]
        ids, mask = _left_pad(chunk, 0)
        L = ids.shape[1]

        def allowed(batch_id, input_ids):
            return kids.get(tuple(input_ids[L:].tolist()), [eos_id])

        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=trie.max_len,
                             do_sample=False, prefix_allowed_tokens_fn=allowed, pad_token_id=0,
                             eos_token_id=eos_id)
        for row in gen[:, L:].tolist():
            path = []
            for t in row:
                path.append(t)
                if path in trie.paths:
                    break
            out.append(trie.paths.index(path))
    return out
