"""DecoderBatch: the running requests of an encoder-decoder as rows of one batch, and the model calls on them.

New requests are encoded in one right-padded encoder call; each keeps its encoder output. A decoder step runs all
rows together over transformers' EncoderDecoderCache, left-padded: padding is masked, and T5's relative position
bias depends only on key minus query position, so it is unchanged by it. A request that ends leaves the cache by
row selection; when requests join, the next step rebuilds the cache by running the decoder over every row's tokens
so far (a cost that grows with their length, paid only in steps where requests arrive).
"""
from __future__ import annotations

from typing import Any

import torch

from engine.seq2seq.request import Seq2SeqRequest


class DecoderBatch:
    def __init__(self, model: Any, device: torch.device, start_id: int) -> None:
        self.model, self.device, self.start_id = model, device, start_id
        self.requests: list[Seq2SeqRequest] = []
        self.cache: Any = None                  # EncoderDecoderCache over the rows; None = rebuild at the next step
        self.encoded = self.encoder_mask = self.decoder_mask = None

    def add(self, joined: list[Seq2SeqRequest]) -> int:
        """Encode `joined` (one padded call) and make them rows; returns their prompt tokens."""
        lengths = [r.num_prompt_tokens for r in joined]
        ids = torch.zeros(len(joined), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(joined):
            ids[i, :lengths[i]] = torch.tensor(r.token_ids)
            mask[i, :lengths[i]] = 1
        hidden = self.model.get_encoder()(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        for i, r in enumerate(joined):
            r.encoded = hidden.last_hidden_state[i, :lengths[i]]
        self.requests += joined
        self.cache = None
        return sum(lengths)

    def next_logits(self) -> torch.Tensor:
        """[rows, vocab] float32 logits of each row's next token."""
        if self.cache is None:
            return self._rebuild()
        last = torch.tensor([[r.decoder_ids[-1]] for r in self.requests], device=self.device)
        ones = torch.ones(len(self.requests), 1, dtype=self.decoder_mask.dtype, device=self.device)
        self.decoder_mask = torch.cat([self.decoder_mask, ones], dim=1)
        return self._forward(last)

    def keep(self, rows: list[int]) -> None:
        """Drop the other rows (ended or aborted requests) from the batch and its cache."""
        self.requests = [self.requests[i] for i in rows]
        if not rows:
            self.cache = None
        elif self.cache is not None:
            index = torch.tensor(rows, device=self.device)
            self.cache.batch_select_indices(index)
            self.encoded, self.encoder_mask = self.encoded[index], self.encoder_mask[index]
            self.decoder_mask = self.decoder_mask[index]

    def clear(self) -> list[Seq2SeqRequest]:
        requests, self.requests, self.cache = self.requests, [], None
        return requests

    def _rebuild(self) -> torch.Tensor:
        """Encoder outputs right-padded, decoder tokens so far left-padded, the cache recomputed from them."""
        from transformers import DynamicCache, EncoderDecoderCache

        rows = self.requests
        source = max(r.encoded.shape[0] for r in rows)
        target = max(len(r.decoder_ids) for r in rows)
        encoded = rows[0].encoded.new_zeros(len(rows), source, rows[0].encoded.shape[-1])
        encoder_mask = torch.zeros(len(rows), source, dtype=torch.long, device=self.device)
        ids = torch.full((len(rows), target), self.start_id, dtype=torch.long)
        decoder_mask = torch.zeros(len(rows), target, dtype=torch.long)
        for i, r in enumerate(rows):
            encoded[i, :r.encoded.shape[0]] = r.encoded
            encoder_mask[i, :r.encoded.shape[0]] = 1
            ids[i, target - len(r.decoder_ids):] = torch.tensor(r.decoder_ids)
            decoder_mask[i, target - len(r.decoder_ids):] = 1
        self.encoded, self.encoder_mask = encoded, encoder_mask
        self.decoder_mask = decoder_mask.to(self.device)
        self.cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        return self._forward(ids.to(self.device))

    def _forward(self, decoder_ids: torch.Tensor) -> torch.Tensor:
        out = self.model(encoder_outputs=(self.encoded,), attention_mask=self.encoder_mask,
                         decoder_input_ids=decoder_ids, decoder_attention_mask=self.decoder_mask,
                         cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1].float()
