//! In-memory suppression of re-delivered perspective work.
//!
//! # Why this exists
//!
//! Completions are reported in batches: after a cycle applies a set of events, the work rows
//! (`event_work_id`s) that were applied are deleted by a later flush, not by the apply itself.
//! Until that flush has committed, a fetch can hand the very same rows back to the engine, and
//! without a filter the handler SQL would run for them a second time. [`ProcessedEventCache`]
//! remembers the work ids the engine has applied recently so the engine can skip them.
//!
//! The cache is a *performance filter, not a correctness primitive*. The durable
//! exactly-once floor is the perspective cursor stored in the database: a row that slips
//! through the cache (after a restart, after TTL expiry, on another instance) is still
//! rejected or made harmless there. Losing the cache therefore costs redundant work, never
//! wrong results; that is why it lives in memory, is per process, and uses plain wall-clock
//! budgets instead of anything stronger.
//!
//! # Two phases
//!
//! An entry has one of two states:
//!
//! * **InFlight** — [`ProcessedEventCache::add_range`] marks ids right after they are applied.
//!   The completion for them has not been acknowledged yet, so the row may be re-delivered at
//!   any moment; an InFlight entry never expires, however long the flush takes.
//! * **Retained** — once the database has acknowledged a completion flush,
//!   [`ProcessedEventCache::activate_retention`] turns *every* InFlight entry into a Retained
//!   one stamped with the acknowledgement time. The work rows are gone now, but a fetch that
//!   started before the delete committed can still return them, so the entry is kept for a
//!   TTL (the worker uses the lease duration). After the TTL, [`ProcessedEventCache::contains`]
//!   answers `false` and [`ProcessedEventCache::evict_expired`] frees the memory.
//!
//! [`ProcessedEventCache::remove_range`] force-removes entries regardless of state; rewind and
//! replay use it so that deliberately re-applied work is not filtered out.
//!
//! # Time
//!
//! Every operation that depends on time takes `now: Instant` from the caller. The cache never
//! reads the clock itself, which keeps it deterministic and lets tests move time freely.
//! An acknowledgement stamped *after* `now` (a caller passing instants out of order) is
//! treated as not yet expired.
//!
//! # Cost
//!
//! Lookups are hash-map lookups. Retention activation touches only the entries added since the
//! previous activation, and eviction touches only the acknowledgement generations that have
//! expired, so neither scans the whole cache (which may hold a lease period's worth of ids).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Callbacks for metrics, logging and test assertions about the dedup cache.
///
/// Every method has a no-op default, so an implementation overrides only what it needs.
/// Callbacks run synchronously on the caller's thread while the cache is being mutated; they
/// should be cheap and must not call back into the cache.
pub trait CacheObserver: Send + Sync {
    /// Ids that [`ProcessedEventCache::add_range`] newly put into the InFlight state (new ids
    /// and re-armed Retained ids; ids that were already InFlight are not repeated).
    fn on_events_marked_in_flight(&self, _ids: &[i64]) {}

    /// Number of InFlight entries that [`ProcessedEventCache::activate_retention`] turned into
    /// Retained ones.
    fn on_retention_activated(&self, _count: usize) {}

    /// Ids that [`ProcessedEventCache::evict_expired`] dropped because their TTL had passed.
    fn on_evicted(&self, _ids: &[i64]) {}

    /// Ids that [`ProcessedEventCache::remove_range`] force-removed (only those that were
    /// present).
    fn on_events_removed(&self, _ids: &[i64]) {}

    /// Ids the engine skipped as duplicates while applying `perspective` for `stream_id`.
    /// Reported by [`ProcessedEventCache::filter_new`], or directly by the engine.
    fn on_events_deduped(&self, _perspective: &str, _stream_id: Uuid, _ids: &[i64]) {}
}

/// State of one cached work id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// Applied, completion not yet acknowledged; never expires. `since` is when it was marked.
    InFlight { since: Instant },
    /// Completion acknowledged at `acked_at`; expires `ttl` later.
    Retained { acked_at: Instant },
}

/// Two-phase TTL cache of recently applied work ids (`event_work_id`). See the
/// [module documentation](self) for the rationale.
///
/// Observer callbacks are only made when something actually changed: an operation that
/// affects no entry does not call the observer.
pub struct ProcessedEventCache {
    ttl: Duration,
    entries: HashMap<i64, Entry>,
    /// Ids put into InFlight since the last activation, in marking order. May hold ids that
    /// were since removed or re-marked; activation checks each against `entries`.
    pending_activation: Vec<i64>,
    /// Number of entries currently InFlight.
    in_flight: usize,
    /// Retained ids grouped by acknowledgement time, for eviction without a full scan. May
    /// hold ids that were since removed or re-armed; eviction checks each against `entries`.
    generations: BTreeMap<Instant, Vec<i64>>,
    observer: Option<Arc<dyn CacheObserver>>,
}

impl ProcessedEventCache {
    /// An empty cache whose Retained entries live for `ttl` after acknowledgement. A zero TTL
    /// makes entries stop matching as soon as retention is activated.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            entries: HashMap::new(),
            pending_activation: Vec::new(),
            in_flight: 0,
            generations: BTreeMap::new(),
            observer: None,
        }
    }

    /// Attaches an observer that is told about every state change (replacing any previous one).
    pub fn with_observer(mut self, observer: Arc<dyn CacheObserver>) -> Self {
        self.observer = Some(observer);
        self
    }

    /// How long a Retained entry keeps matching after its acknowledgement.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Number of entries held, InFlight and Retained, including Retained entries whose TTL has
    /// passed but which [`evict_expired`](Self::evict_expired) has not removed yet.
    pub fn count(&self) -> usize {
        self.entries.len()
    }

    /// Whether the cache holds no entries at all.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Number of entries waiting for an acknowledged completion.
    pub fn in_flight_count(&self) -> usize {
        self.in_flight
    }

    /// How long the oldest InFlight entry has been waiting for its acknowledgement, or `None`
    /// when nothing is InFlight. A steadily growing value means completion flushes are not
    /// being acknowledged.
    pub fn oldest_in_flight_age(&self, now: Instant) -> Option<Duration> {
        self.pending_activation
            .iter()
            .filter_map(|id| match self.entries.get(id) {
                Some(Entry::InFlight { since }) => Some(*since),
                _ => None,
            })
            .min()
            .map(|since| now.saturating_duration_since(since))
    }

    /// Marks `ids` as applied and not yet acknowledged (InFlight).
    ///
    /// Ids that are already InFlight are ignored, so adding the same id twice is harmless.
    /// An id that is currently Retained (acknowledged earlier) goes *back* to InFlight: the
    /// caller only adds ids it has just applied, which means a new completion for it is
    /// outstanding, and the id must stay guarded until *that* completion is acknowledged
    /// rather than until the old retention period runs out.
    ///
    /// Returns how many entries were newly put into InFlight.
    pub fn add_range(&mut self, ids: &[i64], now: Instant) -> usize {
        let mut marked = Vec::new();
        for &id in ids {
            match self.entries.get_mut(&id) {
                // Already guarded; this also skips repeats within `ids`.
                Some(Entry::InFlight { .. }) => continue,
                Some(entry) => *entry = Entry::InFlight { since: now },
                None => {
                    self.entries.insert(id, Entry::InFlight { since: now });
                }
            }
            self.in_flight += 1;
            self.pending_activation.push(id);
            marked.push(id);
        }
        if !marked.is_empty() {
            if let Some(observer) = &self.observer {
                observer.on_events_marked_in_flight(&marked);
            }
        }
        marked.len()
    }

    /// Starts the retention countdown for everything applied so far: every InFlight entry
    /// becomes Retained with its acknowledgement time set to `now`. Entries that are already
    /// Retained keep their original acknowledgement time. Call this after the database has
    /// acknowledged a completion flush.
    ///
    /// Returns how many entries changed state.
    pub fn activate_retention(&mut self, now: Instant) -> usize {
        let mut activated = Vec::new();
        for id in std::mem::take(&mut self.pending_activation) {
            if let Some(entry) = self.entries.get_mut(&id) {
                if matches!(entry, Entry::InFlight { .. }) {
                    *entry = Entry::Retained { acked_at: now };
                    activated.push(id);
                }
            }
        }
        self.in_flight -= activated.len();
        let count = activated.len();
        if count > 0 {
            self.generations.entry(now).or_default().extend(activated);
            if let Some(observer) = &self.observer {
                observer.on_retention_activated(count);
            }
        }
        count
    }

    /// Whether `id` should be treated as already applied: it is InFlight, or Retained and its
    /// TTL has not passed at `now`.
    pub fn contains(&self, id: i64, now: Instant) -> bool {
        match self.entries.get(&id) {
            None => false,
            Some(Entry::InFlight { .. }) => true,
            Some(Entry::Retained { acked_at }) => !self.is_expired(*acked_at, now),
        }
    }

    /// Splits `ids` for one (perspective, stream) apply: returns, in their original order, the
    /// ids that are not [`contains`](Self::contains)ed and so still need applying. The others
    /// are reported to [`CacheObserver::on_events_deduped`] (when there are any).
    pub fn filter_new(
        &self,
        perspective: &str,
        stream_id: Uuid,
        ids: &[i64],
        now: Instant,
    ) -> Vec<i64> {
        let (seen, fresh): (Vec<i64>, Vec<i64>) =
            ids.iter().partition(|&&id| self.contains(id, now));
        if !seen.is_empty() {
            if let Some(observer) = &self.observer {
                observer.on_events_deduped(perspective, stream_id, &seen);
            }
        }
        fresh
    }

    /// Removes Retained entries whose TTL has passed at `now`. InFlight entries are never
    /// evicted. Returns how many entries were removed.
    pub fn evict_expired(&mut self, now: Instant) -> usize {
        // Generations acknowledged at or before `now - ttl` have expired. If that instant is
        // not representable, no acknowledgement can be that old.
        let Some(cutoff) = now.checked_sub(self.ttl) else {
            return 0;
        };
        let mut evicted = Vec::new();
        while let Some(entry) = self.generations.first_entry() {
            if *entry.key() > cutoff {
                break;
            }
            let (acked_at, ids) = entry.remove_entry();
            for id in ids {
                // Skip ids removed or re-armed since; a re-armed id that was retained again
                // has a newer acknowledgement time and sits in a later generation.
                if self.entries.get(&id) == Some(&Entry::Retained { acked_at }) {
                    self.entries.remove(&id);
                    evicted.push(id);
                }
            }
        }
        if !evicted.is_empty() {
            if let Some(observer) = &self.observer {
                observer.on_evicted(&evicted);
            }
        }
        evicted.len()
    }

    /// Force-removes `ids` whatever their state, so that the engine applies them again. Used
    /// by rewind and replay. Returns how many of them were present.
    pub fn remove_range(&mut self, ids: &[i64]) -> usize {
        let mut removed = Vec::new();
        for &id in ids {
            if let Some(entry) = self.entries.remove(&id) {
                if matches!(entry, Entry::InFlight { .. }) {
                    self.in_flight -= 1;
                }
                removed.push(id);
            }
        }
        if !removed.is_empty() {
            if let Some(observer) = &self.observer {
                observer.on_events_removed(&removed);
            }
        }
        removed.len()
    }

    fn is_expired(&self, acked_at: Instant, now: Instant) -> bool {
        now.checked_duration_since(acked_at)
            .is_some_and(|age| age >= self.ttl)
    }
}

impl fmt::Debug for ProcessedEventCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcessedEventCache")
            .field("ttl", &self.ttl)
            .field("count", &self.entries.len())
            .field("in_flight", &self.in_flight)
            .field("has_observer", &self.observer.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    const TTL: Duration = Duration::from_secs(300);

    fn cache() -> ProcessedEventCache {
        ProcessedEventCache::new(TTL)
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Call {
        InFlight(Vec<i64>),
        Activated(usize),
        Evicted(Vec<i64>),
        Removed(Vec<i64>),
        Deduped(String, Uuid, Vec<i64>),
    }

    #[derive(Default)]
    struct Recorder(Mutex<Vec<Call>>);

    impl Recorder {
        fn calls(&self) -> Vec<Call> {
            self.0.lock().unwrap().clone()
        }
        fn push(&self, call: Call) {
            self.0.lock().unwrap().push(call);
        }
    }

    impl CacheObserver for Recorder {
        fn on_events_marked_in_flight(&self, ids: &[i64]) {
            self.push(Call::InFlight(ids.to_vec()));
        }
        fn on_retention_activated(&self, count: usize) {
            self.push(Call::Activated(count));
        }
        fn on_evicted(&self, ids: &[i64]) {
            self.push(Call::Evicted(ids.to_vec()));
        }
        fn on_events_removed(&self, ids: &[i64]) {
            self.push(Call::Removed(ids.to_vec()));
        }
        fn on_events_deduped(&self, perspective: &str, stream_id: Uuid, ids: &[i64]) {
            self.push(Call::Deduped(
                perspective.to_owned(),
                stream_id,
                ids.to_vec(),
            ));
        }
    }

    fn observed() -> (ProcessedEventCache, Arc<Recorder>) {
        let recorder = Arc::new(Recorder::default());
        (cache().with_observer(recorder.clone()), recorder)
    }

    // --- the ProcessedEventCacheTests scenarios ---

    #[test]
    fn contains_on_empty_cache_is_false() {
        let c = cache();
        assert!(!c.contains(1, Instant::now()));
        assert_eq!(c.count(), 0);
        assert!(c.is_empty());
    }

    #[test]
    fn added_ids_are_in_flight_and_contained() {
        let mut c = cache();
        let t0 = Instant::now();
        assert_eq!(c.add_range(&[1, 2, 3], t0), 3);
        for id in [1, 2, 3] {
            assert!(c.contains(id, t0), "id {id}");
        }
        assert!(!c.contains(4, t0));
        assert_eq!(c.count(), 3);
        assert_eq!(c.in_flight_count(), 3);
    }

    #[test]
    fn duplicate_add_is_ignored_without_panicking() {
        let mut c = cache();
        let t0 = Instant::now();
        assert_eq!(c.add_range(&[7, 7], t0), 1);
        assert_eq!(c.add_range(&[7], t0 + Duration::from_secs(1)), 0);
        assert!(c.contains(7, t0));
        assert_eq!(c.count(), 1);
        assert_eq!(c.in_flight_count(), 1);
        // The duplicates did not create extra work for activation either.
        assert_eq!(c.activate_retention(t0), 1);
    }

    #[test]
    fn in_flight_never_expires_until_activated() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        let much_later = t0 + TTL * 1000;
        assert!(c.contains(1, much_later));
        assert_eq!(c.evict_expired(much_later), 0);
        assert!(c.contains(1, much_later));
        assert_eq!(c.count(), 1);
    }

    #[test]
    fn activate_retention_starts_the_countdown_at_activation() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        // The id sat InFlight for a long time; the TTL counts from activation, not from add.
        let acked = t0 + TTL * 10;
        assert_eq!(c.activate_retention(acked), 1);
        assert_eq!(c.in_flight_count(), 0);
        assert!(c.contains(1, acked + TTL - Duration::from_nanos(1)));
        assert!(!c.contains(1, acked + TTL));
    }

    #[test]
    fn activate_retention_only_affects_in_flight_entries() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        c.activate_retention(t0);
        let t1 = t0 + TTL / 2;
        c.add_range(&[2], t1);
        // Only the InFlight id changes state; id 1 keeps its acknowledgement time t0.
        assert_eq!(c.activate_retention(t1), 1);
        assert!(!c.contains(1, t0 + TTL));
        assert!(c.contains(2, t0 + TTL));
        assert!(!c.contains(2, t1 + TTL));
        // Activating again with nothing InFlight changes nothing.
        assert_eq!(c.activate_retention(t1 + TTL / 4), 0);
        assert!(c.contains(2, t1 + TTL - Duration::from_nanos(1)));
    }

    #[test]
    fn retained_entry_before_ttl_is_contained() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        c.activate_retention(t0);
        assert!(c.contains(1, t0));
        assert!(c.contains(1, t0 + TTL / 2));
        assert!(c.contains(1, t0 + TTL - Duration::from_millis(1)));
    }

    #[test]
    fn retained_entry_after_ttl_is_not_contained() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        c.activate_retention(t0);
        assert!(!c.contains(1, t0 + TTL));
        assert!(!c.contains(1, t0 + TTL * 2));
        // Not contained, but still held until evicted.
        assert_eq!(c.count(), 1);
    }

    #[test]
    fn evict_expired_removes_only_retained_entries_past_ttl() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1, 2], t0);
        c.activate_retention(t0);
        let t1 = t0 + TTL / 2;
        c.add_range(&[3], t1);
        c.activate_retention(t1);
        c.add_range(&[4], t1);

        assert_eq!(c.evict_expired(t0 + TTL - Duration::from_nanos(1)), 0);
        assert_eq!(c.evict_expired(t0 + TTL), 2);
        assert_eq!(c.count(), 2);
        assert!(!c.contains(1, t0) && !c.contains(2, t0));
        assert!(c.contains(3, t0 + TTL));
        assert!(c.contains(4, t0 + TTL));

        assert_eq!(c.evict_expired(t1 + TTL), 1);
        assert_eq!(c.count(), 1);
        assert!(c.contains(4, t1 + TTL * 100));
    }

    #[test]
    fn evict_expired_ignores_in_flight_entries() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1, 2, 3], t0);
        assert_eq!(c.evict_expired(t0 + TTL * 1000), 0);
        assert_eq!(c.count(), 3);
        assert_eq!(c.in_flight_count(), 3);
    }

    #[test]
    fn remove_range_clears_entries_for_rewind() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        c.activate_retention(t0);
        c.add_range(&[2, 3], t0);
        // One Retained, one InFlight, one unknown id.
        assert_eq!(c.remove_range(&[1, 2, 99]), 2);
        assert!(!c.contains(1, t0));
        assert!(!c.contains(2, t0));
        assert!(c.contains(3, t0));
        assert_eq!(c.count(), 1);
        assert_eq!(c.in_flight_count(), 1);
        // A removed id can be applied and marked again.
        assert_eq!(c.add_range(&[1], t0), 1);
        assert!(c.contains(1, t0));
    }

    #[test]
    fn count_excludes_expired_entries_after_eviction() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1, 2], t0);
        c.activate_retention(t0);
        c.add_range(&[3], t0);
        assert_eq!(c.count(), 3);
        let later = t0 + TTL;
        assert_eq!(c.count(), 3, "expired entries count until evicted");
        c.evict_expired(later);
        assert_eq!(c.count(), 1);
        assert!(!c.is_empty());
    }

    #[test]
    fn observer_is_told_which_ids_were_marked_in_flight() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        c.add_range(&[1, 2, 2], t0);
        c.add_range(&[2, 3], t0);
        assert_eq!(
            rec.calls(),
            vec![Call::InFlight(vec![1, 2]), Call::InFlight(vec![3])]
        );
    }

    #[test]
    fn observer_is_told_how_many_entries_were_retained() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        c.add_range(&[1, 2, 3], t0);
        c.activate_retention(t0);
        c.add_range(&[4], t0);
        c.activate_retention(t0 + Duration::from_secs(1));
        let activations: Vec<Call> = rec
            .calls()
            .into_iter()
            .filter(|call| matches!(call, Call::Activated(_)))
            .collect();
        assert_eq!(activations, vec![Call::Activated(3), Call::Activated(1)]);
    }

    #[test]
    fn observer_is_told_which_ids_were_evicted() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        c.add_range(&[5, 6], t0);
        c.activate_retention(t0);
        c.add_range(&[7], t0);
        c.evict_expired(t0 + TTL);
        let mut evicted = match rec.calls().last() {
            Some(Call::Evicted(ids)) => ids.clone(),
            other => panic!("expected an eviction, got {other:?}"),
        };
        evicted.sort_unstable();
        assert_eq!(evicted, vec![5, 6]);
    }

    #[test]
    fn observer_is_told_which_ids_were_removed() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        c.add_range(&[1, 2], t0);
        c.remove_range(&[2, 42]);
        assert_eq!(rec.calls().last(), Some(&Call::Removed(vec![2])));
    }

    // --- filter_new and the dedup callback ---

    #[test]
    fn filter_new_returns_unseen_ids_in_order_and_reports_the_rest() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        let stream = Uuid::new_v4();
        c.add_range(&[2, 4], t0);
        let fresh = c.filter_new("order_summary", stream, &[1, 2, 3, 4, 5], t0);
        assert_eq!(fresh, vec![1, 3, 5]);
        assert_eq!(
            rec.calls().last(),
            Some(&Call::Deduped("order_summary".into(), stream, vec![2, 4]))
        );
    }

    #[test]
    fn filter_new_does_not_report_when_nothing_was_deduped() {
        let (c, rec) = observed();
        let fresh = c.filter_new("p", Uuid::nil(), &[1, 2], Instant::now());
        assert_eq!(fresh, vec![1, 2]);
        assert!(rec.calls().is_empty());
    }

    #[test]
    fn filter_new_lets_expired_and_removed_ids_through() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        c.add_range(&[1, 2, 3], t0);
        c.activate_retention(t0);
        c.remove_range(&[2]);
        // 1 and 3 are retained and still live, 2 was removed for a rewind.
        assert_eq!(c.filter_new("p", Uuid::nil(), &[1, 2, 3], t0), vec![2]);
        // After the TTL nothing is filtered, even before eviction.
        assert_eq!(
            c.filter_new("p", Uuid::nil(), &[1, 2, 3], t0 + TTL),
            vec![1, 2, 3]
        );
        let dedups = rec
            .calls()
            .into_iter()
            .filter(|call| matches!(call, Call::Deduped(..)))
            .count();
        assert_eq!(dedups, 1);
    }

    #[test]
    fn filter_new_without_observer_still_filters() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        assert_eq!(c.filter_new("p", Uuid::nil(), &[1, 2], t0), vec![2]);
    }

    // --- further edge cases ---

    #[test]
    fn observer_is_not_called_for_operations_that_change_nothing() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        assert_eq!(c.activate_retention(t0), 0);
        assert_eq!(c.evict_expired(t0 + TTL), 0);
        assert_eq!(c.remove_range(&[1]), 0);
        assert_eq!(c.add_range(&[], t0), 0);
        c.add_range(&[1], t0);
        c.add_range(&[1], t0);
        assert_eq!(rec.calls(), vec![Call::InFlight(vec![1])]);
    }

    #[test]
    fn re_adding_a_retained_id_guards_it_until_the_next_acknowledgement() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        c.activate_retention(t0);
        // Applied again (e.g. by a path that does not filter): a new completion is pending.
        let t1 = t0 + TTL / 2;
        assert_eq!(c.add_range(&[1], t1), 1);
        assert_eq!(rec.calls().last(), Some(&Call::InFlight(vec![1])));
        assert_eq!(c.in_flight_count(), 1);
        // The old retention generation no longer evicts or expires it.
        assert_eq!(c.evict_expired(t0 + TTL * 3), 0);
        assert!(c.contains(1, t0 + TTL * 3));
        // Its new countdown starts at the next activation.
        let t2 = t0 + TTL * 4;
        assert_eq!(c.activate_retention(t2), 1);
        assert!(c.contains(1, t2 + TTL / 2));
        assert_eq!(c.evict_expired(t2 + TTL), 1);
        assert!(c.is_empty());
    }

    #[test]
    fn removing_and_re_adding_before_activation_counts_once() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1, 2], t0);
        c.remove_range(&[1]);
        c.add_range(&[1], t0);
        assert_eq!(c.in_flight_count(), 2);
        assert_eq!(c.activate_retention(t0), 2);
        assert_eq!(c.in_flight_count(), 0);
        assert_eq!(c.evict_expired(t0 + TTL), 2);
        assert!(c.is_empty());
    }

    #[test]
    fn eviction_skips_ids_removed_after_retention() {
        let (mut c, rec) = observed();
        let t0 = Instant::now();
        c.add_range(&[1, 2], t0);
        c.activate_retention(t0);
        c.remove_range(&[1]);
        assert_eq!(c.evict_expired(t0 + TTL), 1);
        assert_eq!(rec.calls().last(), Some(&Call::Evicted(vec![2])));
    }

    #[test]
    fn zero_ttl_stops_matching_as_soon_as_retention_is_activated() {
        let mut c = ProcessedEventCache::new(Duration::ZERO);
        let t0 = Instant::now();
        c.add_range(&[1], t0);
        assert!(c.contains(1, t0));
        c.activate_retention(t0);
        assert!(!c.contains(1, t0));
        assert_eq!(c.evict_expired(t0), 1);
        assert_eq!(c.ttl(), Duration::ZERO);
    }

    #[test]
    fn acknowledgement_later_than_now_is_not_expired() {
        let mut c = cache();
        let t0 = Instant::now();
        let acked = t0 + TTL * 2;
        c.add_range(&[1], t0);
        c.activate_retention(acked);
        // An earlier `now` than the acknowledgement (instants passed out of order).
        assert!(c.contains(1, t0));
        assert_eq!(c.evict_expired(t0 + TTL), 0);
        assert_eq!(c.evict_expired(acked + TTL), 1);
    }

    #[test]
    fn oldest_in_flight_age_tracks_unacknowledged_entries() {
        let mut c = cache();
        let t0 = Instant::now();
        assert_eq!(c.oldest_in_flight_age(t0), None);
        c.add_range(&[1], t0);
        c.add_range(&[2], t0 + Duration::from_secs(5));
        assert_eq!(
            c.oldest_in_flight_age(t0 + Duration::from_secs(10)),
            Some(Duration::from_secs(10))
        );
        c.remove_range(&[1]);
        assert_eq!(
            c.oldest_in_flight_age(t0 + Duration::from_secs(10)),
            Some(Duration::from_secs(5))
        );
        c.activate_retention(t0 + Duration::from_secs(10));
        assert_eq!(c.oldest_in_flight_age(t0 + Duration::from_secs(10)), None);
    }

    #[test]
    fn debug_output_summarises_without_listing_ids() {
        let mut c = cache();
        c.add_range(&[1, 2], Instant::now());
        let text = format!("{c:?}");
        assert!(text.contains("count: 2"), "{text}");
        assert!(text.contains("has_observer: false"), "{text}");
    }
}
