-- 0021: a worker's graceful stop is recorded on its instance. hand_over_streams (the first step
-- of the stop) sets `stopping_since`; from then on claims leave the instance out of the share of
-- unowned streams, hand-overs and heartbeats no longer count it among the live peers, and its
-- in-flight wh_drain calls take no further pair. Before, it counted as live until it
-- deregistered at the very end of its stop: the new streams of its partition share waited for
-- that (half of all new streams while two workers ran), and so did the pairs its drain calls
-- had not reached. NULL: not stopping.
-- Template: `{{schema}}` is the deployment's schema (see 0001).

ALTER TABLE {{schema}}.wh_service_instances ADD COLUMN stopping_since timestamptz;
