"""The coordinating side of the round across a transport, driven by events alone (no stream,
no model): what is verified next and what each verdict commits."""

from types import SimpleNamespace

from specd.speculation.sequencer import Sequencer

PROMPT = [1, 2, 3]
EOS = frozenset({0})


def tok(position, token, epoch=0):
    return SimpleNamespace(epoch=epoch, position=position, token=token, prob=1.0, entropy=0.0, q=None)


def end(start, stop, epoch=0, repeat=0, side_tokens=(), side_parents=()):
    return SimpleNamespace(epoch=epoch, start=start, end=stop, repeat=repeat,
                           side_tokens=side_tokens, side_parents=side_parents)


def seq(overlap=False, drafting=True, max_length=20):
    return Sequencer(PROMPT, max_length=max_length, eos=EOS, overlap=overlap, drafting=drafting)


def test_sequential_verifies_whole_windows_and_waits_for_each_acknowledgement():
    s = seq()
    assert s.next_chunk() is None  # nothing drafted yet
    s.proposed(tok(3, 7))
    s.proposed(tok(4, 8))
    assert s.next_chunk() is None  # the window has not ended
    s.window_ended(end(3, 5))
    chunk = s.next_chunk()
    assert chunk.start == 3 and [t.token for t in chunk.drafts] == [7, 8]
    c = s.verified(chunk, 1, 9)  # 7 kept, 9 recovered in 8's place
    assert (c.tokens, c.emitted, c.k, c.n, c.finish_reason, c.notify) == ([7, 9], [7, 9], 2, 1, None, True)
    assert s.seq == PROMPT + [7, 9] and s.drafts == {} and s.window_ends == []
    s.proposed(tok(5, 4))  # drafted on the old guess, before the draft saw the commit
    s.window_ended(end(5, 6))
    assert s.next_chunk() is None  # the commit is not acknowledged
    s.acknowledged(1)  # the draft rolled back: epoch 1
    assert s.drafts == {} and s.window_ends == [] and s.next_chunk() is None
    s.proposed(tok(5, 4, epoch=0))  # a stale one arriving late
    assert s.drafts == {}
    s.proposed(tok(5, 6, epoch=1))
    s.window_ended(end(5, 6, epoch=1))
    assert [t.token for t in s.next_chunk().drafts] == [6]


def test_pearl_starts_without_the_draft_and_sends_a_window_as_far_as_it_goes():
    s = seq(overlap=True)
    first = s.next_chunk()
    assert first.drafts == []  # the first token does not wait for the draft's prefill
    assert s.verified(first, 0, 5).tokens == [5]
    s.acknowledged(0)
    assert s.next_chunk() is None  # nothing drafted after the first token yet
    s.proposed(tok(4, 6))
    assert [t.token for t in s.next_chunk().drafts] == [6]  # pre-verify: the open window's first draft
    s.proposed(tok(5, 7))
    s.window_ended(end(4, 6))
    s.proposed(tok(6, 8))  # the next window, drafted while the current one is verified
    chunk = s.next_chunk()
    assert [t.token for t in chunk.drafts] == [6, 7]  # up to the window's end, not into the next
    c = s.verified(chunk, 2, 8)  # all accepted; the bonus equals the next window's first draft
    assert c.continuation_kept and c.tokens == [6, 7, 8]
    assert 6 not in s.drafts  # settled by the commit


def test_promised_plain_rounds_need_no_acknowledgement_and_run_back_to_back():
    s = seq()
    s.window_ended(end(3, 3, repeat=3))
    chunk = s.next_chunk()
    assert chunk.drafts == [] and s.steps(chunk, back_to_back=True) == 3 and s.steps(chunk, back_to_back=False) == 1
    s.verified(chunk, 0, 5)
    assert s.next_chunk().drafts == []  # unacknowledged, but a promised plain round
    s.verified(s.next_chunk(), 0, 6)
    s.verified(s.next_chunk(), 0, 7)
    assert s.unacked == 3 and s.next_chunk() is None  # past the promise: wait for the draft


def test_eos_and_the_length_cut_a_verdict_and_end_without_telling_the_draft():
    s = seq()
    for i, t in enumerate([7, 0, 8]):
        s.proposed(tok(3 + i, t))
    s.window_ended(end(3, 6))
    c = s.verified(s.next_chunk(), 3, 9)
    assert (c.emitted, c.finish_reason, c.notify) == ([7, 0], "stop", False)
    s = seq(max_length=5)
    s.window_ended(end(3, 3))
    c = s.verified(s.next_chunk(), 0, 4)
    assert c.finish_reason is None
    s.acknowledged(0)
    assert s.next_chunk().drafts == []  # the last token: nothing may be drafted
    assert s.verified(s.next_chunk(), 0, 4).finish_reason == "length"


def test_without_a_draft_every_chunk_is_a_multi_step_run_to_the_end():
    s = seq()
    s.proposed(tok(3, 7))
    s.stop_drafting()  # the draft service died
    chunk = s.next_chunk()
    assert chunk.drafts == [] and s.steps(chunk, back_to_back=True) == 20 - 3
    assert not s.verified(chunk, 0, 5).notify


def test_a_whole_window_grown_into_a_tree_carries_its_side_nodes_and_commits_the_path():
    s = seq()
    s.proposed(tok(3, 7))
    s.proposed(tok(4, 8))
    s.window_ended(end(3, 5, side_tokens=(11, 12), side_parents=(-1, 0)))
    chunk = s.next_chunk()
    assert (chunk.side_tokens, chunk.side_parents) == ((11, 12), (-1, 0))
    c = s.verified(chunk, 2, 13, accepted_tokens=[7, 12])  # the path took a side node
    assert c.tokens == [7, 12, 13] and not c.continuation_kept


def test_pearl_verifies_a_window_before_the_stretch_promised_after_it():
    """PEARL: the draft declines the round after a window it has not heard back on, promising
    four plain rounds from position 6. The window's drafts are verified first. If the verdict
    keeps them all, the stretch starts right after (the bonus token was its first round); if it
    rejects one, the promise (made on the discarded drafts) goes once the draft acknowledges."""
    def drafted():
        s = seq(overlap=True)
        s.verified(s.next_chunk(), 0, 9)  # the first token, without the draft
        s.acknowledged(0)
        for i, t in enumerate([7, 8, 4]):
            s.proposed(tok(4 + i, t))
        s.window_ended(end(4, 7))
        s.window_ended(end(7, 7, repeat=4))
        return s

    s = drafted()
    chunk = s.next_chunk()
    assert [t.token for t in chunk.drafts] == [7, 8, 4]  # not a plain round: the window first
    s.verified(chunk, 3, 5)  # all kept, 5 is the bonus at 7
    chunk = s.next_chunk()
    assert chunk.start == 8 and chunk.drafts == [] and s.steps(chunk, back_to_back=True) == 3

    s = drafted()
    s.verified(s.next_chunk(), 1, 6)  # 8 rejected at 5: the draft rolls back
    assert s.next_chunk() is None  # not the stretch: its promise awaits the acknowledgement
    s.acknowledged(1)
    assert s.plain_until == 0 and s.next_chunk() is None  # waits for the new drafts
    s.proposed(tok(6, 3, epoch=1))
    assert [t.token for t in s.next_chunk().drafts] == [3]
