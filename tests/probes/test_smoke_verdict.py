"""The smoke verdict on recorded responses: content, thinking left on, the silence loop."""

from fleet.probes.smoke import EMPTY_THOUGHT, judge_smoke


def response(content, reasoning=None, tokens=16, finish="length"):
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    return {"choices": [{"message": message, "finish_reason": finish}], "usage": {"completion_tokens": tokens}}


def test_content_passes():
    assert judge_smoke(response("Yes, I can hear you.", tokens=7, finish="stop"), 16).passed


def test_thinking_left_on_fails_with_that_diagnosis():
    result = judge_smoke(response("", reasoning="The user asks whether..."), 16)
    assert not result.passed and "thinking is on" in result.diagnosis


def test_silence_loop_fails():
    result = judge_smoke(response(EMPTY_THOUGHT * 4, tokens=16), 16)
    assert not result.passed and "silence loop" in result.diagnosis


def test_empty_content_at_the_limit_fails():
    result = judge_smoke(response(None, tokens=16), 16)
    assert not result.passed and result.diagnosis == "empty content at the token limit"


def test_malformed_response_fails():
    assert not judge_smoke({"error": "x"}, 16).passed
