"""Is a stored transcript one that a run of children.Steps could have saved?"""

from __future__ import annotations

from agent_sessions import ContentType, Message, Role

from .children import ANSWER, QUESTION, call, result


def run_transcript(msgs: list[Message], steps: int, sent: list[str], *, complete: bool) -> list[str]:
    """Check ``msgs`` message by message: the question, then calls each followed at once by their result,
    steers anywhere between, the answer once all steps are done. Steers appear once each, in the order
    they were sent; ``complete`` also asks for the answer and every steer. Returns the steers held."""
    if not msgs and not complete:
        return []  # killed before its first save: nothing stored is a valid prefix too
    assert msgs and msgs[0] == Message.user(QUESTION), f"the transcript does not start with the question: {msgs[:1]}"
    k, i, answered, steers = 0, 1, False, []
    while i < len(msgs):
        m = msgs[i]
        if m.role is Role.USER and m.content and m.content[0].type is ContentType.TEXT:
            steers.append(m.text)
            i += 1
        elif m == call(k):
            assert i + 1 < len(msgs) and msgs[i + 1] == result(k), f"call {k} (message {i}) stored without its result"
            k, i = k + 1, i + 2
        elif m == ANSWER and k == steps:
            answered, i = True, i + 1
        else:
            raise AssertionError(f"message {i} is not one the run could have saved: {m}")
    assert len(steers) == len(set(steers)), f"a steer was saved twice: {steers}"
    assert set(steers) <= set(sent), f"a steer nobody sent: {set(steers) - set(sent)}"
    assert steers == [s for s in sent if s in set(steers)], f"steers out of the order they were sent: {steers}"
    if complete:
        assert answered, "the resumed run did not finish"
        assert steers == sent, f"steers lost: {[s for s in sent if s not in steers]}"
    return steers
