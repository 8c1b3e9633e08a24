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
//! Only the custom-runner path (rows fetched and applied through a `PerspectiveRunner`) uses
//! it: compiled SQL perspectives are claimed and applied by `wh_drain` in one transaction, so
//! their rows never travel to the worker.
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
use std::time::{Duration, Instant};

/// State of one cached work id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// Applied, completion not yet acknowledged; never expires.
    InFlight,
    /// Completion acknowledged at `acked_at`; expires `ttl` later.
    Retained { acked_at: Instant },
}

/// Two-phase TTL cache of recently applied work ids (`event_work_id`). See the
/// [module documentation](self) for the rationale.
pub struct ProcessedEventCache {
    ttl: Duration,
    entries: HashMap<i64, Entry>,
    /// Ids put into InFlight since the last activation, in marking order.
    pending_activation: Vec<i64>,
    /// Number of entries currently InFlight.
    in_flight: usize,
    /// Retained ids grouped by acknowledgement time, for eviction without a full scan. May
    /// hold ids that were since re-armed; eviction checks each against `entries`.
    generations: BTreeMap<Instant, Vec<i64>>,
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
        }
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

    /// Marks `ids` as applied and not yet acknowledged (InFlight).
    ///
    /// Ids that are already InFlight are ignored, so adding the same id twice is harmless.
    /// An id that is currently Retained (acknowledged earlier) goes *back* to InFlight: the
    /// caller only adds ids it has just applied, which means a new completion for it is
    /// outstanding, and the id must stay guarded until *that* completion is acknowledged
    /// rather than until the old retention period runs out.
    ///
    /// Returns how many entries were newly put into InFlight.
    pub fn add_range(&mut self, ids: &[i64]) -> usize {
        let mut marked = 0;
        for &id in ids {
            match self.entries.get_mut(&id) {
                // Already guarded; this also skips repeats within `ids`.
                Some(Entry::InFlight) => continue,
                Some(entry) => *entry = Entry::InFlight,
                None => {
                    self.entries.insert(id, Entry::InFlight);
                }
            }
            self.in_flight += 1;
            self.pending_activation.push(id);
            marked += 1;
        }
        marked
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
                if matches!(entry, Entry::InFlight) {
                    *entry = Entry::Retained { acked_at: now };
                    activated.push(id);
                }
            }
        }
        self.in_flight -= activated.len();
        let count = activated.len();
        if count > 0 {
            self.generations.entry(now).or_default().extend(activated);
        }
        count
    }

    /// Whether `id` should be treated as already applied: it is InFlight, or Retained and its
    /// TTL has not passed at `now`.
    pub fn contains(&self, id: i64, now: Instant) -> bool {
        match self.entries.get(&id) {
            None => false,
            Some(Entry::InFlight) => true,
            Some(Entry::Retained { acked_at }) => !self.is_expired(*acked_at, now),
        }
    }

    /// Removes Retained entries whose TTL has passed at `now`. InFlight entries are never
    /// evicted. Returns how many entries were removed.
    pub fn evict_expired(&mut self, now: Instant) -> usize {
        // Generations acknowledged at or before `now - ttl` have expired. If that instant is
        // not representable, no acknowledgement can be that old.
        let Some(cutoff) = now.checked_sub(self.ttl) else {
            return 0;
        };
        let mut evicted = 0;
        while let Some(entry) = self.generations.first_entry() {
            if *entry.key() > cutoff {
                break;
            }
            let (acked_at, ids) = entry.remove_entry();
            for id in ids {
                // Skip ids re-armed since; one that was retained again has a newer
                // acknowledgement time and sits in a later generation.
                if self.entries.get(&id) == Some(&Entry::Retained { acked_at }) {
                    self.entries.remove(&id);
                    evicted += 1;
                }
            }
        }
        evicted
    }

    fn is_expired(&self, acked_at: Instant, now: Instant) -> bool {
        now.checked_duration_since(acked_at)
            .is_some_and(|age| age >= self.ttl)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(300);

    fn cache() -> ProcessedEventCache {
        ProcessedEventCache::new(TTL)
    }

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
        assert_eq!(c.add_range(&[1, 2, 3]), 3);
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
        assert_eq!(c.add_range(&[7, 7]), 1);
        assert_eq!(c.add_range(&[7]), 0);
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
        c.add_range(&[1]);
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
        c.add_range(&[1]);
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
        c.add_range(&[1]);
        c.activate_retention(t0);
        let t1 = t0 + TTL / 2;
        c.add_range(&[2]);
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
        c.add_range(&[1]);
        c.activate_retention(t0);
        assert!(c.contains(1, t0));
        assert!(c.contains(1, t0 + TTL / 2));
        assert!(c.contains(1, t0 + TTL - Duration::from_millis(1)));
    }

    #[test]
    fn retained_entry_after_ttl_is_not_contained() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1]);
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
        c.add_range(&[1, 2]);
        c.activate_retention(t0);
        let t1 = t0 + TTL / 2;
        c.add_range(&[3]);
        c.activate_retention(t1);
        c.add_range(&[4]);

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
        c.add_range(&[1, 2, 3]);
        assert_eq!(c.evict_expired(t0 + TTL * 1000), 0);
        assert_eq!(c.count(), 3);
        assert_eq!(c.in_flight_count(), 3);
    }

    #[test]
    fn count_excludes_expired_entries_after_eviction() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1, 2]);
        c.activate_retention(t0);
        c.add_range(&[3]);
        assert_eq!(c.count(), 3);
        let later = t0 + TTL;
        assert_eq!(c.count(), 3, "expired entries count until evicted");
        c.evict_expired(later);
        assert_eq!(c.count(), 1);
        assert!(!c.is_empty());
    }

    #[test]
    fn re_adding_a_retained_id_guards_it_until_the_next_acknowledgement() {
        let mut c = cache();
        let t0 = Instant::now();
        c.add_range(&[1]);
        c.activate_retention(t0);
        // Applied again (e.g. by a path that does not filter): a new completion is pending.
        assert_eq!(c.add_range(&[1]), 1);
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
    fn zero_ttl_stops_matching_as_soon_as_retention_is_activated() {
        let mut c = ProcessedEventCache::new(Duration::ZERO);
        let t0 = Instant::now();
        c.add_range(&[1]);
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
        c.add_range(&[1]);
        c.activate_retention(acked);
        // An earlier `now` than the acknowledgement (instants passed out of order).
        assert!(c.contains(1, t0));
        assert_eq!(c.evict_expired(t0 + TTL), 0);
        assert_eq!(c.evict_expired(acked + TTL), 1);
    }
}
