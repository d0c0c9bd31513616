"""The model runner's pooling (runner="pooling"): a step's final hidden states in, the pooled
result of every request whose prompt ends in the step out.

A prompt may run in several chunks (chunked prefill), so a MEAN request keeps the running sum of
its tokens' states, a token_embed request its rows so far, and a CLS request its first row;
LAST needs nothing before the chunk that ends the prompt (and may start from a prefix-cache hit:
the scheduler lets only LAST embed requests read the cache). A preempted request is removed here
and recomputed from its first token, so its partial state starts again.

A classifier's requests (task "classify") pool the same way and then go through its `score` head,
all of a step's at once: softmax over the labels, or a sigmoid for a one-label model (a
cross-encoder's relevance), unless the request turned the activation off.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from collections.abc import Callable

from tokenloom.messages import PooledData
from tokenloom.pooling_params import CLASSIFY_TASKS, TOKEN_TASKS, PoolerConfig, PoolingParams


class Pooler:
    def __init__(self, config: PoolerConfig,
                 classifier: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        """`classifier`: a sequence classifier's score head (the model's dtype in, one logit per
        label out)."""
        assert config.pooling_type is not None  # resolved by model/pooling_config.resolve_pooling
        self.pooling_type = config.pooling_type
        self.classifier = classifier
        self.dtype = dtype
        self.params: dict[str, PoolingParams] = {}
        self._partial: dict[str, torch.Tensor | list[torch.Tensor]] = {}

    def add_request(self, req_id: str, params: PoolingParams | None) -> None:
        if params is None:
            raise ValueError("a pooling engine (runner='pooling') runs pooling requests only")
        self.params[req_id] = params
        self._partial.pop(req_id, None)

    def remove_request(self, req_id: str) -> None:
        self.params.pop(req_id, None)
        self._partial.pop(req_id, None)

    def __call__(self, hidden: torch.Tensor, req_ids: list[str], query_start_loc: np.ndarray,
                 computed: np.ndarray, seq_lens: np.ndarray, num_prompt_tokens: np.ndarray,
                 skip: set[str]) -> dict[str, PooledData]:
        """Pools the requests of one step (in their order; `computed`: tokens before the step,
        `seq_lens`: after it). Requests in `skip` (failed in this step) are left out."""
        done = seq_lens >= num_prompt_tokens
        out: dict[str, PooledData] = {}
        last_rows = torch.from_numpy(query_start_loc[1:] - 1)
        finals: list[tuple[str, torch.Tensor]] = []
        # The embed requests that end now and pool the last token: one gather for all of them.
        last_pos = [i for i, r in enumerate(req_ids) if done[i] and r not in skip
                    and self._kind(r) == "LAST"]
        if last_pos:
            rows = hidden.index_select(0, last_rows[last_pos].to(hidden.device)).float()
            finals += [(req_ids[i], rows[k]) for k, i in enumerate(last_pos)]
        for i, req_id in enumerate(req_ids):
            if req_id in skip:
                continue
            kind = self._kind(req_id)
            if kind == "LAST":
                continue
            start, end = int(query_start_loc[i]), int(query_start_loc[i + 1])
            chunk = hidden[start:end].float()
            if kind == "ALL":
                parts = self._partial.setdefault(req_id, [])
                assert isinstance(parts, list)
                parts.append(chunk.clone())
            elif kind == "MEAN":
                total = chunk.sum(0)
                prev = self._partial.get(req_id)
                self._partial[req_id] = total if prev is None else prev + total  # type: ignore[operator]
            elif int(computed[i]) == 0:  # CLS: the prompt's first token is in this chunk
                self._partial[req_id] = chunk[0].clone()
            if done[i]:
                state = self._partial.pop(req_id)
                if kind == "ALL":
                    finals.append((req_id, torch.cat(state)))  # type: ignore[arg-type]
                elif kind == "MEAN":
                    finals.append((req_id, state / int(num_prompt_tokens[i])))  # type: ignore[operator]
                else:
                    finals.append((req_id, state))  # type: ignore[arg-type]
        finals = self._classify(finals)
        for req_id, vec in finals:
            params = self.params[req_id]
            if params.dimensions is not None:
                vec = vec[..., : params.dimensions]
            if params.normalize:
                vec = F.normalize(vec, p=2, dim=-1)
            arr = vec.contiguous().cpu().numpy().astype("<f4", copy=False)
            out[req_id] = PooledData(shape=list(arr.shape), data=arr.tobytes())
        return out

    def _classify(self, finals: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The classify and token_classify requests' pooled states (one row, or one per token)
        through the score head, in one product; the other requests' as they are."""
        todo = [k for k, (req_id, _) in enumerate(finals)
                if self.params[req_id].task in CLASSIFY_TASKS]
        if not todo:
            return finals
        if self.classifier is None:  # the processor refuses classify on a model without the head
            raise RuntimeError("classify request on a model without a score head")
        rows = [finals[k][1].reshape(-1, finals[k][1].shape[-1]) for k in todo]
        logits = self.classifier(torch.cat(rows).to(self.dtype)).float()
        probs = torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        finals = list(finals)
        start = 0
        for k, part in zip(todo, rows):
            req_id, end = finals[k][0], start + part.shape[0]
            params = self.params[req_id]
            out = (probs if params.use_activation else logits)[start:end]
            finals[k] = (req_id, out[0] if params.task == "classify" else out)
            start = end
        return finals

    def token_types(self, req_ids: list[str], num_sched: np.ndarray, computed: np.ndarray) -> torch.Tensor:
        """Each scheduled token's type [T] (an encoder's token_type_ids): 1 from its request's
        `token_type_start` on (a cross-encoder pair's second text), else 0."""
        never = np.iinfo(np.int64).max
        starts = np.fromiter((never if (p := self.params.get(r)) is None or p.token_type_start is None
                              else p.token_type_start for r in req_ids), dtype=np.int64, count=len(req_ids))
        offsets = np.concatenate([np.arange(c, c + n) for c, n in zip(computed.tolist(), num_sched.tolist())])
        return torch.from_numpy((offsets >= np.repeat(starts, num_sched)).astype(np.int64))

    def _kind(self, req_id: str) -> str:
        return "ALL" if self.params[req_id].task in TOKEN_TASKS else self.pooling_type
