"""What a front end serves, by name: the served model and its classifiers (one named like the
model, or those --classifier declared), each with the Prompt that tokenizes for it, built from the
engine's Ready. A request names a classifier by `classifier`, or by `model` as vLLM's requests name
a served model or a LoRA adapter (the served model's name: the default classifier); the catalog
turns names into the indices the engine's messages carry, or answers 404 (422 when two names
disagree). Cards describe them for /healthz and /v1/models. With a scorer, the catalog also holds
the request side of /v1/score (score_input.ScoreInput over the score template's Prompt), so that
the front end checks and tokenizes score requests as it does classify requests.
"""
from __future__ import annotations

from . import protocol as P
from .api_error import ApiError

DEFAULT_MODEL = "default/not-specified"  # what Infinity's client sends when no model is named


class Catalog:
    def __init__(self, info: P.ReadyOut, prompts: list):
        """prompts: one per info.classifiers, checked to split each prompt as the engine does."""
        if len(prompts) != len(info.classifiers) or any(
                list(p.prefix_ids) != list(c.prefix_ids) for p, c in zip(prompts, info.classifiers)):
            raise RuntimeError("this front end's tokenizer splits the prompt differently from the "
                               "engine's")
        for p, c in zip(prompts, info.classifiers):
            p.context_limit = c.context_limit
        self.model, self.prompts, self.classifiers = info.model, prompts, info.classifiers
        # None: no /v1/score on this engine
        self.scoring = None if info.scorer is None else score_input(info.scorer, prompts[0].tokenizer,
                                                                    _table(info.scorer))
        self.names = [c.name for c in info.classifiers]
        self.index = {name: k for k, name in enumerate(self.names)}

    def resolve(self, model: str | None = None, classifier: str | None = None) -> int:
        """The index of the classifier a request names (none: the default, 0)."""
        if model is None and classifier is None:
            return 0
        if classifier is not None:
            k = self.index.get(classifier)
            if k is None:
                raise ApiError(404, f"The classifier `{classifier}` does not exist ({self.serves()}).",
                               param="classifier")
            if model is not None and model != classifier:
                self._model_only(model, f"classifier names `{classifier}`")
            return k
        k = self.index.get(model)
        if k is not None:
            return k
        self._model_only(model, "")
        return 0

    def resolve_many(self, model: str | None, classifiers: list[str]) -> list[int]:
        """The indices of the classifiers one request asks for (`classifiers`)."""
        if not classifiers:
            raise ApiError(422, "classifiers is an empty list", param="classifiers")
        if len(set(classifiers)) != len(classifiers):
            raise ApiError(422, "classifiers names a classifier twice", param="classifiers")
        ks = []
        for name in classifiers:
            k = self.index.get(name)
            if k is None:
                raise ApiError(404, f"The classifier `{name}` does not exist ({self.serves()}).",
                               param="classifiers")
            ks.append(k)
        if model is not None:
            self._model_only(model, "classifiers names several")
        return ks

    def _model_only(self, model: str, beside: str) -> None:
        """`model` where it cannot pick a classifier: only the served model's name (or none) fits."""
        if model in (self.model, DEFAULT_MODEL):
            return
        if model in self.index and beside:
            raise ApiError(422, f"model `{model}` names a classifier and {beside}: name one",
                           param="model")
        raise ApiError(404, f"The model `{model}` does not exist ({self.serves()}).", param="model")

    def serves(self) -> str:
        if self.names == [self.model]:
            return f"this server serves `{self.model}`"
        return (f"this server serves `{self.model}` with the classifiers "
                f"{', '.join(f'`{n}`' for n in self.names)}")

    def health_cards(self) -> list[dict]:
        """Each classifier in /healthz: what it answers, and the bytes it adds to the weights
        every classifier shares (Classifier.memory; model_bytes: those weights)."""
        out = []
        for c in self.classifiers:
            m = c.memory
            out.append({"name": c.name, "labels": c.labels, "mode": c.mode, "adapter": c.adapter,
                        "prefix_tokens": len(c.prefix_ids),
                        "memory": {**m, "added_bytes": sum(v for k, v in m.items() if k != "model_bytes")}})
        return out

    def model_cards(self, created: int) -> list[dict]:
        """OpenAI's model list as vLLM lists a model and its LoRA adapters: the served model (the
        default classifier's labels), then each classifier named otherwise, its parent the model."""
        default = self.classifiers[0]
        cards = [] if self.model in self.index else [self._card(self.model, default, None, created)]
        return cards + [self._card(c.name, c, None if c.name == self.model else self.model, created)
                        for c in self.classifiers]

    def _card(self, name: str, c: P.ClassifierInfo, parent: str | None, created: int) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "prefixscore",
                "root": self.model, "parent": parent, "max_model_len": c.context_limit,
                "labels": c.labels}


def _table(info: P.ScorerInfo):
    """The engine's item table, mapped again here (safetensors: the pages are shared)."""
    if info.item_table is None:
        return None
    from ..item_table import ItemTable

    return ItemTable.load(info.item_table)


def score_input(info: P.ScorerInfo, tokenizer, table=None):
    """The engine's Scorer's request side over this front end's tokenizer (every prompt's): its
    Prompt rebuilt from the template, checked to split as the engine's does; table: the item table
    (item_table.ItemTable) that items given by id are looked up in."""
    from ..prompt import Prompt
    from ..score_input import SLOTS, ScoreInput

    prompt = None
    if info.template is not None:
        prompt = Prompt(tokenizer, info.template, chat=info.chat, slots=SLOTS,
                        special_tokens=info.special_tokens)
        if list(prompt.prefix_ids) != list(info.prefix_ids):
            raise RuntimeError("this front end's tokenizer splits the score template differently "
                               "from the engine's")
    inp = ScoreInput(prompt, info.item_first, info.vocab_size, info.context_limit, info.max_items,
                     info.hidden_size or None, table)
    if prompt is not None:
        inp.template_tokens()  # now, not in the first request (its cost limit reads them)
    return inp
