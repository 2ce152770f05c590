"""Wire types of the pooling routes: OpenAI embeddings, TEI's /embed /rerank /predict, and the Cohere/Jina rerank
and score shapes that vLLM serves (/v1/rerank, /v1/score). No engine types here."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictInt, StrictStr

from engine.server.protocol import _Wire

TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Direction = Literal["Left", "Right", "left", "right"]
# sentence-transformers' encode_query / encode_document (Voyage AI's `input_type` names them the same way)
InputType = Literal["query", "document"]
FloatVector = list[float]


# --- OpenAI /v1/embeddings ----------------------------------------------------------------------

class EmbeddingRequest(_Wire):
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)     # Matryoshka: the first N, renormalized
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # vLLM: keep the last N tokens; -1 = the most
    truncate: bool = False      # TEI's: cut at the model's limit from the right, as sentence-transformers does
    prompt_name: str | None = None      # a name in config_sentence_transformers.json's prompts, as TEI's /embed
    input_type: InputType | None = None


class EmbeddingData(_Wire):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: FloatVector | str                        # base64 of little-endian float32 with encoding_format


class PoolingUsage(_Wire):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Wire):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


# --- TEI /embed, /rerank, /predict --------------------------------------------------------------

class EmbedRequest(_Wire):
    inputs: StrictStr | list[StrictStr]
    normalize: bool = True
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    prompt_name: str | None = None
    input_type: InputType | None = None
    dimensions: int | None = Field(default=None, ge=1)


class RerankRequest(_Wire):
    query: StrictStr
    texts: list[StrictStr]
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    raw_scores: bool = False
    return_text: bool = False


class Rank(_Wire):
    index: int
    score: float
    text: str | None = None


class PredictRequest(_Wire):
    # one text, one [text, text_pair], or a batch of either
    inputs: StrictStr | list[StrictStr] | list[list[StrictStr]]
    truncate: bool | None = None
    truncation_direction: Direction = "Right"
    raw_scores: bool = False


class Prediction(_Wire):
    score: float
    label: str


# --- Cohere / Jina /v1/rerank, vLLM /v1/score --------------------------------------------------

class RerankDocument(_Wire):
    text: StrictStr


class CohereRerankRequest(_Wire):
    model: str | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)         # 0 or absent: all
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class RerankResult(_Wire):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(_Wire):
    total_tokens: int


class CohereRerankResponse(_Wire):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreRequest(_Wire):
    model: str | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)


class ScoreData(_Wire):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(_Wire):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


# JSON schemas of the bare-list answers (TEI answers arrays, not objects)
EMBED_RESPONSE: dict[str, Any] = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
PREDICT_RESPONSE: dict[str, Any] = {"anyOf": [
    {"type": "array", "items": {"$ref": "#/components/schemas/Prediction"}},
    {"type": "array", "items": {"type": "array", "items": {"$ref": "#/components/schemas/Prediction"}}}]}
