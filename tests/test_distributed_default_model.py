"""The real default model (SmolLM2-135M: 9 attention heads, 3 KV heads) tensor-parallel
over 3 ranks on loopback, through the openai SDK."""

from __future__ import annotations

import pytest

from distributed_group import RankGroup


@pytest.mark.slow
def test_three_ranks_serve_the_default_model_through_the_openai_sdk(tmp_path, default_model_dir) -> None:
    import openai

    group = RankGroup(tmp_path, default_model_dir, 3)
    try:
        client = openai.OpenAI(base_url=group.url("/v1"), api_key="unused")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                               temperature=0)
        assert reply.usage.completion_tokens > 0 and reply.choices[0].message.content
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(
                               model=model, messages=messages, max_tokens=12, temperature=0,
                               stream=True) if chunk.choices)
        assert streamed == reply.choices[0].message.content
        engine = group.health()["engines"][model]
        assert (engine["distributed_ranks"], engine["distributed_mode"]) == (3, "tensor")
        assert group.stop() == [0, 0, 0], group.output()
    finally:
        group.close()


@pytest.mark.slow
def test_two_ranks_are_refused_for_the_default_model_with_what_would_work(tmp_path, default_model_dir) -> None:
    with pytest.raises(AssertionError) as failed:
        RankGroup(tmp_path, default_model_dir, 2, ready_timeout_s=300)
    assert "9 attention heads, 3 KV heads do not divide by 2 ranks: use 3 ranks" in str(failed.value)
