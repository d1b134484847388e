"""The field matrix (batchfile/fields.py) names every request field of the official openai SDK's request types and
of vLLM's request models, for each endpoint: none is accepted by default and dropped."""

from __future__ import annotations

import typing

import pytest

from batch_dagster.batchfile import contract as c
from batch_dagster.batchfile.fields import FIELDS


def sdk_fields(module) -> set[str]:
    """Every key of the module's create-params TypedDicts (the streaming and non-streaming ones alike)."""
    names: set[str] = set()
    for attr in dir(module):
        params = getattr(module, attr)
        if attr.endswith(("Params", "ParamsBase", "Streaming", "NonStreaming")) and isinstance(params, type):
            names |= set(typing.get_type_hints(params))
    return names


def vllm_fields(*models) -> set[str]:
    return {name for model in models for name in model.model_fields}


def endpoints():
    from anthropic.types import message_create_params
    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from openai.types.responses import response_create_params
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingChatRequest, EmbeddingCompletionRequest
    from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest

    return {
        c.CHAT: (sdk_fields(chat_create_params), vllm_fields(ChatCompletionRequest)),
        c.COMPLETIONS: (sdk_fields(completion_create_params), vllm_fields(CompletionRequest)),
        c.EMBEDDINGS: (sdk_fields(embedding_create_params),
                       vllm_fields(EmbeddingCompletionRequest, EmbeddingChatRequest)),
        c.RESPONSES: (sdk_fields(response_create_params), vllm_fields(ResponsesRequest)),
        # vLLM's own endpoints: the openai SDK has no request type for them.
        c.SCORE: (set(), vllm_fields(*typing.get_args(ScoreRequest))),
        c.RERANK: (set(), vllm_fields(RerankRequest)),
        # Anthropic's: the anthropic SDK's request type, and vLLM's Messages layer's.
        c.MESSAGES: (sdk_fields(message_create_params), vllm_fields(AnthropicMessagesRequest)),
    }


@pytest.mark.parametrize("url", c.ENDPOINTS)
def test_the_matrix_names_every_field_of_the_sdk_and_of_vllm(url):
    sdk, vllm = endpoints()[url]
    assert (len(sdk) >= 5 or url in (c.SCORE, c.RERANK)) and len(vllm) >= 10  # the types were found
    table = set(FIELDS[url])
    assert sdk - table == set(), f"SDK fields missing from the matrix of {url}"
    assert vllm - table == set(), f"vLLM fields missing from the matrix of {url}"
    # Ours beyond both: only the thinking switch (moved into chat_template_kwargs for vLLM).
    assert table - sdk - vllm <= {"enable_thinking"}
