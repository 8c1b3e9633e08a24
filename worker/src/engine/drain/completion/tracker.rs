//! Bookkeeping for batched completion (and failure) reports.
//!
//! The engine does not write a completion to the database the moment a perspective has
//! applied its events; it queues the report and a flush later sends many of them in one round
//! trip. [`CompletionTracker`] holds those queued reports and follows each one through
//!
//! ```text
//! Pending --take_pending_for_send--> Sent --mark_acknowledged--> Acknowledged --clear_acknowledged--> (gone)
//!    ^                                 |
//!    +------------reset_stale----------+   (no acknowledgement within the retry delay)
//! ```
//!
//! * **Pending**: queued, not yet handed to a flush.
//! * **Sent**: handed to a flush at `sent_at`; the flush has not confirmed it yet.
//! * **Acknowledged**: the flush confirmed it; it only waits to be cleared.
//!
//! A flush reports *how many* items it persisted, so acknowledgement is by count: the oldest
//! Sent items (by send time, then by the order they were added) are the ones acknowledged.
//! A Sent item whose acknowledgement does not arrive within its retry delay is returned to
//! Pending by [`CompletionTracker::reset_stale`] and goes out with a later flush; the delay
//! grows with every retry according to a [`RetryPolicy`].
//!
//! Losing a report is not fatal: the work row stays in the database, at or below its cursor,
//! and the next drain of its stream retires it without applying it again (`wh_drain` retires
//! such rows; a custom runner skips them by the cursor, and the dedup cache saves it the work).
//! The tracker's retries make that recovery faster and cheaper, nothing more.
//!
//! The engine keeps one tracker, in the completion flush worker; failures are not queued (the
//! apply transaction, or for a custom runner one statement, records them at once). The tracker
//! never reads the clock; callers pass `now`.

use std::time::{Duration, Instant};

use crate::config::RetryOptions;

/// How long a Sent item may wait for its acknowledgement before it is sent again.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RetryPolicy {
    /// Delay before the first retry, and the delay of every retry without exponential backoff.
    pub base: Duration,
    /// Factor applied to the delay per retry. Values below 1.0 and NaN are treated as 1.0
    /// (the delay never shrinks); +infinity jumps straight to `max` after the first retry.
    pub multiplier: f64,
    /// Upper bound of the delay with exponential backoff. A `max` below `base` is treated as
    /// `base`, so no retry ever waits less than `base`.
    pub max: Duration,
    /// Whether the delay grows with the retry count; if not, every retry waits `base`.
    pub exponential: bool,
}

impl RetryPolicy {
    /// The policy configured by the worker's `retryOptions`.
    pub fn from_options(options: &RetryOptions) -> Self {
        Self {
            base: Duration::from_secs(options.retry_timeout_seconds.into()),
            multiplier: options.backoff_multiplier,
            max: Duration::from_secs(options.max_backoff_seconds.into()),
            exponential: options.enable_exponential_backoff,
        }
    }

    /// How long an item that has already been retried `retry_count` times may stay Sent
    /// before it is considered lost: `base * multiplier^retry_count`, capped at `max`, or
    /// `base` when exponential backoff is off. Never panics, whatever the inputs.
    pub fn delay(&self, retry_count: u32) -> Duration {
        if !self.exponential || retry_count == 0 {
            return self.base;
        }
        let cap = self.max.max(self.base);
        // `!(x >= 1.0)` also catches NaN.
        let multiplier = if self.multiplier >= 1.0 {
            self.multiplier
        } else {
            1.0
        };
        // An exponent beyond i32 only matters for multipliers above 1, where the result
        // already saturates to infinity (and so to `cap`) long before.
        let exponent = i32::try_from(retry_count).unwrap_or(i32::MAX);
        let secs = self.base.as_secs_f64() * multiplier.powi(exponent);
        if secs.is_nan() || secs >= cap.as_secs_f64() {
            return cap;
        }
        Duration::try_from_secs_f64(secs).map_or(cap, |delay| delay.clamp(self.base, cap))
    }
}

impl Default for RetryPolicy {
    /// The policy of the default `retryOptions` (1 s, doubling, at most 60 s).
    fn default() -> Self {
        Self::from_options(&RetryOptions::default())
    }
}

/// Where a tracked item is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompletionState {
    /// Queued, waiting for the next flush.
    Pending,
    /// Handed to a flush at `sent_at`, not yet confirmed.
    Sent {
        /// When the item was handed to the flush.
        sent_at: Instant,
    },
    /// Confirmed by a flush; removed by the next [`CompletionTracker::clear_acknowledged`].
    Acknowledged,
}

/// One item in a [`CompletionTracker`], with its state and retry count.
#[derive(Debug, Clone, PartialEq)]
pub struct Tracked<T> {
    seq: u64,
    item: T,
    state: CompletionState,
    retry_count: u32,
}

impl<T> Tracked<T> {
    /// The report itself.
    pub fn item(&self) -> &T {
        &self.item
    }

    /// Where the item is in its lifecycle.
    pub fn state(&self) -> CompletionState {
        self.state
    }

    /// How many times the item went back from Sent to Pending for lack of an acknowledgement.
    pub fn retry_count(&self) -> u32 {
        self.retry_count
    }
}

/// Tracks queued reports through Pending → Sent → Acknowledged. See the
/// [module documentation](self).
///
/// Items are kept in the order they were added; "oldest first" always means that order.
#[derive(Debug, Clone)]
pub struct CompletionTracker<T> {
    items: Vec<Tracked<T>>,
    next_seq: u64,
    policy: RetryPolicy,
}

impl<T: Clone> Default for CompletionTracker<T> {
    fn default() -> Self {
        Self::new(RetryPolicy::default())
    }
}

impl<T: Clone> CompletionTracker<T> {
    /// An empty tracker that retries unacknowledged items according to `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            items: Vec::new(),
            next_seq: 0,
            policy,
        }
    }

    /// The retry policy used by [`reset_stale`](Self::reset_stale).
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Queues `item` as Pending.
    pub fn add(&mut self, item: T) {
        self.items.push(Tracked {
            seq: self.next_seq,
            item,
            state: CompletionState::Pending,
            retry_count: 0,
        });
        self.next_seq += 1;
    }

    /// Copies of the Pending items, oldest first. Changes nothing.
    pub fn pending(&self) -> Vec<T> {
        self.items
            .iter()
            .filter(|tracked| tracked.state == CompletionState::Pending)
            .map(|tracked| tracked.item.clone())
            .collect()
    }

    /// Marks every Pending item as Sent at `now` and returns copies of them, oldest first.
    /// Call this when handing the items to a flush.
    pub fn take_pending_for_send(&mut self, now: Instant) -> Vec<T> {
        self.take_pending_up_to(usize::MAX, now)
    }

    /// Like [`take_pending_for_send`](Self::take_pending_for_send), but takes at most `max`
    /// items (the oldest); the rest stay Pending for a later flush.
    pub fn take_pending_up_to(&mut self, max: usize, now: Instant) -> Vec<T> {
        let mut taken = 0;
        self.take_pending_while(now, |_| {
            taken += 1;
            taken <= max
        })
    }

    /// Like [`take_pending_up_to`](Self::take_pending_up_to), but takes the oldest Pending items
    /// for as long as `admit` (shown each in turn) accepts them.
    pub fn take_pending_while(
        &mut self,
        now: Instant,
        mut admit: impl FnMut(&T) -> bool,
    ) -> Vec<T> {
        let mut taken = Vec::new();
        for tracked in self
            .items
            .iter_mut()
            .filter(|tracked| tracked.state == CompletionState::Pending)
        {
            if !admit(&tracked.item) {
                break;
            }
            tracked.state = CompletionState::Sent { sent_at: now };
            taken.push(tracked.item.clone());
        }
        taken
    }

    /// Acknowledges the `count` oldest Sent items: earliest `sent_at` first, ties broken by
    /// the order they were added. Asking for more than are Sent acknowledges all of them.
    /// Pending items are never acknowledged. Returns how many were acknowledged.
    pub fn mark_acknowledged(&mut self, count: usize) -> usize {
        if count == 0 {
            return 0;
        }
        let mut sent: Vec<(Instant, u64, usize)> = self
            .items
            .iter()
            .enumerate()
            .filter_map(|(index, tracked)| match tracked.state {
                CompletionState::Sent { sent_at } => Some((sent_at, tracked.seq, index)),
                _ => None,
            })
            .collect();
        let count = count.min(sent.len());
        if count < sent.len() {
            sent.select_nth_unstable(count);
        }
        for &(_, _, index) in &sent[..count] {
            self.items[index].state = CompletionState::Acknowledged;
        }
        count
    }

    /// Drops every Acknowledged item; Pending and Sent items stay. Returns how many were
    /// dropped.
    pub fn clear_acknowledged(&mut self) -> usize {
        let before = self.items.len();
        self.items
            .retain(|tracked| tracked.state != CompletionState::Acknowledged);
        before - self.items.len()
    }

    /// Returns to Pending every Sent item that has waited at least
    /// [`RetryPolicy::delay`]`(retry_count)` since it was sent, incrementing its retry count,
    /// so the next flush sends it again. An item whose `sent_at` lies after `now` is not
    /// stale. Returns how many items were reset.
    pub fn reset_stale(&mut self, now: Instant) -> usize {
        let mut reset = 0;
        for tracked in &mut self.items {
            let CompletionState::Sent { sent_at } = tracked.state else {
                continue;
            };
            let waited = now.checked_duration_since(sent_at);
            if waited.is_some_and(|waited| waited >= self.policy.delay(tracked.retry_count)) {
                tracked.state = CompletionState::Pending;
                tracked.retry_count = tracked.retry_count.saturating_add(1);
                reset += 1;
            }
        }
        reset
    }

    /// Returns every Sent item to Pending at once, whatever its backoff (a last flush before
    /// stopping does not wait out a retry delay). Retry counts are kept. Returns how many.
    pub fn resend_all(&mut self) -> usize {
        let mut reset = 0;
        for tracked in &mut self.items {
            if matches!(tracked.state, CompletionState::Sent { .. }) {
                tracked.state = CompletionState::Pending;
                reset += 1;
            }
        }
        reset
    }

    /// Number of Pending items.
    pub fn pending_count(&self) -> usize {
        self.count_in(|state| state == CompletionState::Pending)
    }

    /// Number of Sent items.
    pub fn sent_count(&self) -> usize {
        self.count_in(|state| matches!(state, CompletionState::Sent { .. }))
    }

    /// Number of Acknowledged items not yet cleared.
    pub fn acknowledged_count(&self) -> usize {
        self.count_in(|state| state == CompletionState::Acknowledged)
    }

    /// Number of items in any state.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether the tracker holds no items.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Every item with its state, oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &Tracked<T>> {
        self.items.iter()
    }

    fn count_in(&self, wanted: impl Fn(CompletionState) -> bool) -> usize {
        self.items
            .iter()
            .filter(|tracked| wanted(tracked.state))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    /// Stand-ins for the two report kinds the engine tracks.
    #[derive(Debug, Clone, PartialEq)]
    struct Completion(&'static str);

    #[derive(Debug, Clone, PartialEq)]
    struct Failure(&'static str, &'static str);

    fn policy(base_secs: u64, multiplier: f64, max_secs: u64, exponential: bool) -> RetryPolicy {
        RetryPolicy {
            base: Duration::from_secs(base_secs),
            multiplier,
            max: Duration::from_secs(max_secs),
            exponential,
        }
    }

    fn tracker<T: Clone>() -> CompletionTracker<T> {
        CompletionTracker::new(RetryPolicy::default())
    }

    fn states<T: Clone>(t: &CompletionTracker<T>) -> (usize, usize, usize) {
        (t.pending_count(), t.sent_count(), t.acknowledged_count())
    }

    // --- batched part of PerspectiveCompletionStrategyTests ---

    #[test]
    fn reported_completion_is_only_queued() {
        let mut t = tracker();
        t.add(Completion("a"));
        assert_eq!(states(&t), (1, 0, 0));
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn reported_failure_is_only_queued() {
        let mut t = tracker();
        t.add(Failure("a", "boom"));
        assert_eq!(states(&t), (1, 0, 0));
    }

    #[test]
    fn pending_returns_collected_completions_oldest_first() {
        let mut t = tracker();
        t.add(Completion("a"));
        t.add(Completion("b"));
        assert_eq!(t.pending(), vec![Completion("a"), Completion("b")]);
        // Reading does not change state.
        assert_eq!(t.pending(), vec![Completion("a"), Completion("b")]);
        assert_eq!(states(&t), (2, 0, 0));
    }

    #[test]
    fn pending_returns_collected_failures() {
        let mut t = tracker();
        t.add(Failure("a", "x"));
        t.add(Failure("b", "y"));
        assert_eq!(t.pending(), vec![Failure("a", "x"), Failure("b", "y")]);
    }

    #[test]
    fn acknowledgement_flow_removes_acknowledged_items() {
        let mut t = tracker();
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.add(Completion("b"));
        assert_eq!(t.take_pending_for_send(t0).len(), 2);
        assert_eq!(t.mark_acknowledged(2), 2);
        assert_eq!(t.clear_acknowledged(), 2);
        assert!(t.pending().is_empty());
        assert!(t.is_empty());
        assert_eq!(states(&t), (0, 0, 0));
    }

    // --- BatchedCompletionStrategyLifecycleTests ---

    #[test]
    fn sending_moves_items_from_pending_to_sent() {
        let mut t = tracker();
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.add(Completion("b"));
        let sent = t.take_pending_for_send(t0);
        assert_eq!(sent, vec![Completion("a"), Completion("b")]);
        assert!(t.pending().is_empty());
        assert_eq!(states(&t), (0, 2, 0));
        assert!(t
            .iter()
            .all(|tracked| tracked.state() == CompletionState::Sent { sent_at: t0 }));
        // Nothing left to send.
        assert!(t.take_pending_for_send(t0).is_empty());
    }

    #[test]
    fn completions_and_failures_are_tracked_independently() {
        let mut completions = tracker();
        let mut failures = tracker();
        let t0 = Instant::now();
        completions.add(Completion("a"));
        completions.add(Completion("b"));
        failures.add(Failure("c", "boom"));

        completions.take_pending_for_send(t0);
        assert_eq!(states(&completions), (0, 2, 0));
        assert_eq!(states(&failures), (1, 0, 0));

        failures.take_pending_for_send(t0);
        // A flush that persisted 2 completions and 0 failures.
        assert_eq!(completions.mark_acknowledged(2), 2);
        assert_eq!(failures.mark_acknowledged(0), 0);
        assert_eq!(states(&completions), (0, 0, 2));
        assert_eq!(states(&failures), (0, 1, 0));
    }

    #[test]
    fn acknowledged_after_sent_can_be_cleared() {
        let mut t = tracker();
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.take_pending_for_send(t0);
        assert_eq!(t.mark_acknowledged(1), 1);
        assert_eq!(states(&t), (0, 0, 1));
        assert_eq!(t.clear_acknowledged(), 1);
        assert!(t.is_empty());
    }

    #[test]
    fn pending_items_cannot_be_acknowledged() {
        let mut t = tracker();
        t.add(Completion("a"));
        assert_eq!(t.mark_acknowledged(1), 0);
        assert_eq!(t.clear_acknowledged(), 0);
        assert_eq!(states(&t), (1, 0, 0));
    }

    #[test]
    fn clear_acknowledged_keeps_sent_and_pending_items() {
        let mut t = tracker();
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.add(Completion("b"));
        t.take_pending_for_send(t0);
        t.add(Completion("c"));
        t.mark_acknowledged(1);
        assert_eq!(t.clear_acknowledged(), 1);
        assert_eq!(states(&t), (1, 1, 0));
        let left: Vec<_> = t.iter().map(|tracked| tracked.item().clone()).collect();
        assert_eq!(left, vec![Completion("b"), Completion("c")]);
    }

    #[test]
    fn resend_all_returns_every_sent_item_to_pending_without_waiting() {
        let mut t = CompletionTracker::new(policy(60, 2.0, 600, true));
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.add(Completion("b"));
        t.take_pending_for_send(t0);
        assert_eq!(t.reset_stale(t0), 0, "the backoff has not passed");
        t.add(Completion("c"));
        t.mark_acknowledged(1);
        assert_eq!(t.resend_all(), 1, "b: a is acknowledged, c was never sent");
        assert_eq!(t.pending(), vec![Completion("b"), Completion("c")]);
        assert_eq!(states(&t), (2, 0, 1));
    }

    #[test]
    fn reset_stale_returns_an_old_sent_item_to_pending() {
        let mut t = CompletionTracker::new(policy(1, 2.0, 60, true));
        let t0 = Instant::now();
        t.add(Completion("old"));
        t.take_pending_for_send(t0);
        t.add(Completion("fresh"));
        t.take_pending_for_send(t0 + SECOND / 2);

        assert_eq!(t.reset_stale(t0 + SECOND - Duration::from_nanos(1)), 0);
        assert_eq!(t.reset_stale(t0 + SECOND), 1);
        assert_eq!(t.pending(), vec![Completion("old")]);
        assert_eq!(states(&t), (1, 1, 0));
        let old = t.iter().next().unwrap();
        assert_eq!(old.retry_count(), 1);
        assert_eq!(old.state(), CompletionState::Pending);
    }

    #[test]
    fn each_retry_doubles_the_stale_threshold() {
        let mut t = CompletionTracker::new(policy(1, 2.0, 60, true));
        let mut now = Instant::now();
        t.add(Completion("a"));
        for (retry, wait_secs) in [1, 2, 4, 8, 16, 32].into_iter().enumerate() {
            t.take_pending_for_send(now);
            let wait = Duration::from_secs(wait_secs);
            assert_eq!(
                t.reset_stale(now + wait - Duration::from_millis(1)),
                0,
                "retry {retry}"
            );
            now += wait;
            assert_eq!(t.reset_stale(now), 1, "retry {retry}");
            assert_eq!(t.iter().next().unwrap().retry_count(), retry as u32 + 1);
        }
    }

    #[test]
    fn stale_threshold_is_capped_at_max() {
        let mut t = CompletionTracker::new(policy(1, 2.0, 5, true));
        let mut now = Instant::now();
        t.add(Completion("a"));
        // Delays 1, 2, 4, then 5 (capped) from the fourth retry on.
        for wait_secs in [1, 2, 4, 5, 5, 5] {
            t.take_pending_for_send(now);
            now += Duration::from_secs(wait_secs);
            assert_eq!(t.reset_stale(now), 1, "after waiting {wait_secs}s");
        }
        assert_eq!(t.policy().delay(100), Duration::from_secs(5));
    }

    #[test]
    fn multiplier_one_keeps_the_threshold_constant() {
        let p = policy(3, 1.0, 60, true);
        for retry in [0, 1, 2, 10, u32::MAX] {
            assert_eq!(p.delay(retry), Duration::from_secs(3));
        }
    }

    #[test]
    fn without_exponential_backoff_every_retry_waits_base() {
        let p = policy(3, 2.0, 60, false);
        for retry in [0, 1, 5, u32::MAX] {
            assert_eq!(p.delay(retry), Duration::from_secs(3));
        }
        let mut t = CompletionTracker::new(p);
        let mut now = Instant::now();
        t.add(Completion("a"));
        for _ in 0..4 {
            t.take_pending_for_send(now);
            now += Duration::from_secs(3);
            assert_eq!(t.reset_stale(now), 1);
        }
        assert_eq!(t.iter().next().unwrap().retry_count(), 4);
    }

    #[test]
    fn acknowledging_more_than_sent_is_safe() {
        let mut t = tracker();
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.add(Completion("b"));
        t.take_pending_for_send(t0);
        t.add(Completion("c"));
        assert_eq!(t.mark_acknowledged(10), 2);
        assert_eq!(states(&t), (1, 0, 2));
        assert_eq!(t.mark_acknowledged(usize::MAX), 0);
    }

    // --- ordering and edge cases ---

    #[test]
    fn acknowledgement_takes_the_earliest_sent_first() {
        let mut t = CompletionTracker::new(policy(1, 2.0, 60, true));
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.add(Completion("b"));
        t.take_pending_for_send(t0);
        // "a" times out and is re-sent later than "c", which was added after it.
        t.add(Completion("c"));
        t.take_pending_for_send(t0 + SECOND / 2);
        t.reset_stale(t0 + SECOND);
        assert_eq!(t.pending(), vec![Completion("a"), Completion("b")]);
        t.take_pending_for_send(t0 + SECOND * 2);

        // Sent times: c at 0.5 s; a and b at 2 s (a added first).
        assert_eq!(t.mark_acknowledged(2), 2);
        let acknowledged: Vec<_> = t
            .iter()
            .filter(|tracked| tracked.state() == CompletionState::Acknowledged)
            .map(|tracked| tracked.item().clone())
            .collect();
        assert_eq!(acknowledged, vec![Completion("a"), Completion("c")]);
        let still_sent: Vec<_> = t
            .iter()
            .filter(|tracked| matches!(tracked.state(), CompletionState::Sent { .. }))
            .map(|tracked| tracked.item().clone())
            .collect();
        assert_eq!(still_sent, vec![Completion("b")]);
    }

    #[test]
    fn ties_in_send_time_are_acknowledged_in_insertion_order() {
        let mut t = tracker();
        let t0 = Instant::now();
        for name in ["a", "b", "c", "d", "e"] {
            t.add(Completion(name));
        }
        t.take_pending_for_send(t0);
        assert_eq!(t.mark_acknowledged(3), 3);
        t.clear_acknowledged();
        let left: Vec<_> = t.iter().map(|tracked| tracked.item().clone()).collect();
        assert_eq!(left, vec![Completion("d"), Completion("e")]);
    }

    #[test]
    fn take_pending_up_to_sends_only_the_oldest() {
        let mut t = tracker();
        let t0 = Instant::now();
        for name in ["a", "b", "c"] {
            t.add(Completion(name));
        }
        assert_eq!(
            t.take_pending_up_to(2, t0),
            vec![Completion("a"), Completion("b")]
        );
        assert_eq!(t.pending(), vec![Completion("c")]);
        assert!(t.take_pending_up_to(0, t0).is_empty());
        assert_eq!(states(&t), (1, 2, 0));
    }

    #[test]
    fn reset_stale_leaves_pending_acknowledged_and_future_items_alone() {
        let mut t = CompletionTracker::new(policy(1, 2.0, 60, true));
        let t0 = Instant::now();
        t.add(Completion("acked"));
        t.take_pending_for_send(t0);
        t.mark_acknowledged(1);
        t.add(Completion("future"));
        t.take_pending_for_send(t0 + SECOND * 100);
        t.add(Completion("pending"));
        assert_eq!(t.reset_stale(t0 + SECOND * 50), 0);
        assert_eq!(states(&t), (1, 1, 1));
        assert!(t.iter().all(|tracked| tracked.retry_count() == 0));
    }

    #[test]
    fn zero_base_makes_every_sent_item_immediately_stale() {
        let mut t = CompletionTracker::new(policy(0, 2.0, 60, true));
        let t0 = Instant::now();
        t.add(Completion("a"));
        t.take_pending_for_send(t0);
        assert_eq!(t.reset_stale(t0), 1);
    }

    #[test]
    fn policy_from_default_options() {
        let p = RetryPolicy::from_options(&RetryOptions::default());
        assert_eq!(p, RetryPolicy::default());
        assert_eq!(p.base, SECOND);
        assert_eq!(p.multiplier, 2.0);
        assert_eq!(p.max, Duration::from_secs(60));
        assert!(p.exponential);
        let delays: Vec<u64> = (0..9).map(|retry| p.delay(retry).as_secs()).collect();
        assert_eq!(delays, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
    }

    #[test]
    fn policy_from_custom_options() {
        let options = RetryOptions {
            retry_timeout_seconds: 5,
            enable_exponential_backoff: false,
            backoff_multiplier: 3.0,
            max_backoff_seconds: 120,
        };
        let p = RetryPolicy::from_options(&options);
        assert_eq!(p, policy(5, 3.0, 120, false));
        assert_eq!(p.delay(4), Duration::from_secs(5));
    }

    #[test]
    fn delay_survives_degenerate_inputs() {
        let max = Duration::from_secs(60);
        // Huge retry counts saturate at the cap instead of overflowing.
        assert_eq!(policy(1, 2.0, 60, true).delay(u32::MAX), max);
        assert_eq!(policy(1, 1.5, 60, true).delay(10_000), max);
        // Infinite multiplier: base first, then straight to the cap.
        assert_eq!(policy(1, f64::INFINITY, 60, true).delay(0), SECOND);
        assert_eq!(policy(1, f64::INFINITY, 60, true).delay(1), max);
        // NaN and shrinking multipliers behave like 1.0.
        assert_eq!(policy(2, f64::NAN, 60, true).delay(3), SECOND * 2);
        assert_eq!(policy(2, 0.5, 60, true).delay(3), SECOND * 2);
        assert_eq!(policy(2, -2.0, 60, true).delay(3), SECOND * 2);
        // 0 × ∞ is NaN; it resolves to the cap rather than panicking.
        assert_eq!(policy(0, f64::INFINITY, 60, true).delay(1), max);
        // Zero base stays zero.
        assert_eq!(policy(0, 2.0, 60, true).delay(5), Duration::ZERO);
        // A cap below the base never undercuts the base.
        assert_eq!(policy(10, 2.0, 3, true).delay(2), Duration::from_secs(10));
        // The largest representable durations do not overflow either.
        let huge = RetryPolicy {
            base: Duration::MAX,
            multiplier: 2.0,
            max: Duration::MAX,
            exponential: true,
        };
        assert_eq!(huge.delay(3), Duration::MAX);
    }

    #[test]
    fn fractional_multiplier_and_sub_second_base() {
        let p = RetryPolicy {
            base: Duration::from_millis(100),
            multiplier: 1.5,
            max: Duration::from_secs(1),
            exponential: true,
        };
        assert_eq!(p.delay(0), Duration::from_millis(100));
        assert_eq!(p.delay(1).as_millis(), 150);
        assert_eq!(p.delay(2).as_millis(), 225);
        assert_eq!(p.delay(20), Duration::from_secs(1));
    }

    #[test]
    fn retry_count_survives_many_resets() {
        let mut t = CompletionTracker::new(policy(0, 1.0, 0, false));
        let t0 = Instant::now();
        t.add(Completion("a"));
        for _ in 0..1000 {
            t.take_pending_for_send(t0);
            assert_eq!(t.reset_stale(t0), 1);
        }
        assert_eq!(t.iter().next().unwrap().retry_count(), 1000);
    }
}
