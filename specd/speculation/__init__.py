"""The speculative round, read top to bottom (docs/engine.md, "The round"):

1. `proposer.Proposer`: a drafter proposes a window under a stopping policy, which decides after every token (specd.policies);
   `should_draft` may make it a plain step (k = 0), or a stretch of them.
2. `verifier.Verifier` (`round.judged_window`, then specd.verify for chains or specd.tree for
   trees): the target's logits for the window, with penalties and grammar applied, give a
   *verdict*, committed to the target's cache; every driver verifies with it.
3. `round.commit_tokens`: the verdict's tokens appended, cut at EOS or the length; stop
   strings cut the text after (specd.detok).
4. Feedback: the Proposer's commit tells the policy the window's outcome (RoundOutcome.judged)
   and the round's time (`pace.PaceClock`, one clock for every driver); costs are fed to the
   process's cost model (specd.cost_model).

Across a transport (or a thread) the round has three sides, each with no transport in it:
`proposer.Proposer` drafts windows ahead of the committed sequence under the policy, with
epochs and rollbacks (PEARL: the next window while this one is verified); `verifier.Verifier`
judges a window against the target's logits and commits the verdict; `sequencer.Sequencer`
decides what the target verifies next and what each verdict commits, with PEARL's overlap,
promised plain rounds and rollbacks.

Who moves these steps' events:
- in process, `driver.RoundDriver` (specd.engine.GenerationRun): a Proposer drafting on the
  caller's thread, a Sequencer and a Verifier, one round after the other;
- in process with PEARL, `overlap.Overlap` (specd.engine.OverlapRun): the same round with the
  Proposer on a thread of its own;
- across the services, `services.coordinator.loop.RequestLoop` (streams, timeouts, fallback)
  around a Sequencer, with `services.draft.runner.DraftRunner` moving a Proposer and
  `services.target` a Verifier per session (`services.target.session.TargetSession`);
- drafting on the target, `services.target.drafting.LocalDrafting`: a Proposer per session
  drafting a window between the target's forwards, its verdicts judged in the batched step
  (services.common.batcher).
"""
