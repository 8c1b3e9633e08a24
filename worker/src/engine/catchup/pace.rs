//! How hard a catch-up (backfill, rebuild, blue/green build) runs its chunks.
//!
//! Without live work (the claim loop found none for a while) it runs at full speed: a chunk loop
//! per drain consumer. Beside live work it runs as fast as the live perspectives allow: the pace
//! goes up a step while the worst live apply latency of the last second stays under half of
//! [`LIVE_LATENCY_TARGET`], and is halved when it goes over the target (additive increase,
//! multiplicative decrease, as TCP's congestion window), so a catch-up takes what the machine
//! has to spare and gives it back within a second when the live events start to wait. It never
//! goes below one chunk loop at half duty (a catch-up must end; a lower floor made a custom
//! runner's queued backfill crawl), so it cannot always keep the live latency under the target.
//! While live work exists but nothing was applied in the last second there is no measure: it
//! holds.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The live apply latency (append → applied, the worst of the last second) over which a
/// catch-up beside live work slows down: the README's "Beside live work a catch-up takes what
/// the live perspectives leave". The goal for a live perspective beside a catch-up is a p99
/// under 250 ms; the worst of each second is above its p99, so 200 ms keeps under it. (At 100 ms
/// the pace never left its floor beside 500 live events/s on 2 cores, where the live p99 of each
/// second was 40–95 ms even at the floor: a blue/green build ran at 11–30% of the steady state.)
pub const LIVE_LATENCY_TARGET: Duration = Duration::from_millis(200);
/// At most one step up per this long: a step's effect shows in the latency within it.
const STEP_UP_INTERVAL: Duration = Duration::from_millis(250);
/// At most one halving per this long: the latency window (a second) must forget the slow
/// events of before the last halving first.
const STEP_DOWN_INTERVAL: Duration = Duration::from_secs(1);
/// Where the pace starts when live work appears: the floor, one chunk loop at half duty.
const START_LEVEL: u32 = 0;

/// What the live perspectives show, for the pace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Live {
    /// No live work (the claim loop found none for a while): full speed.
    Idle,
    /// Live work, but nothing applied in the last second: no measure, hold.
    Unmeasured,
    /// The worst append → applied latency of the last second.
    Latency(Duration),
}

/// The pace of one job runner.
pub(crate) struct Pace {
    consumers: u32,
    state: Mutex<State>,
}

#[derive(Debug, Clone, Copy)]
struct State {
    level: u32,
    /// Whether the last chunk ran beside live work.
    live: bool,
    stepped_up: Option<Instant>,
    stepped_down: Option<Instant>,
}

impl Pace {
    /// A pace for a worker with `drain_consumers` drain consumers.
    pub(crate) fn new(drain_consumers: u32) -> Pace {
        Pace {
            consumers: drain_consumers.max(1),
            state: Mutex::new(State {
                level: START_LEVEL,
                live: false,
                stepped_up: None,
                stepped_down: None,
            }),
        }
    }

    /// The highest level: every chunk loop at full duty.
    fn top(&self) -> u32 {
        self.consumers
    }

    /// `(chunk loops, pause after each chunk as a multiple of its duration)` for a level: 0 is
    /// one loop at half duty, 1 one loop at full duty, and each level above adds a loop, up to
    /// one per drain consumer.
    fn setting(&self, level: u32) -> (u32, f64) {
        match level {
            0 => (1, 1.0),
            l => (l.min(self.consumers), 0.0),
        }
    }

    /// The pace for the next chunk: full speed without live work; beside it, adjusted by a step
    /// when the live perspectives' latency calls for one and one is due.
    pub(crate) fn next(&self, live: Live) -> (u32, f64) {
        self.next_at(live, Instant::now())
    }

    fn next_at(&self, live: Live, now: Instant) -> (u32, f64) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if live == Live::Idle {
            s.live = false;
            return self.setting(self.top());
        }
        if !s.live {
            // Live work again: start low and climb, rather than hit the live events at full
            // speed.
            *s = State {
                level: START_LEVEL,
                live: true,
                stepped_up: Some(now),
                stepped_down: None,
            };
        }
        let Live::Latency(latency) = live else {
            return self.setting(s.level);
        };
        let due = |at: Option<Instant>, every: Duration| at.is_none_or(|at| now - at >= every);
        if latency > LIVE_LATENCY_TARGET {
            if s.level > 0 && due(s.stepped_down, STEP_DOWN_INTERVAL) {
                s.level /= 2;
                s.stepped_down = Some(now);
                s.stepped_up = Some(now);
            }
        } else if latency < LIVE_LATENCY_TARGET / 2
            && s.level < self.top()
            && due(s.stepped_up, STEP_UP_INTERVAL)
        {
            s.level += 1;
            s.stepped_up = Some(now);
        }
        self.setting(s.level)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn without_live_work_every_consumer_runs_a_loop_at_full_duty() {
        let p = Pace::new(4);
        assert_eq!(p.next(Live::Idle), (4, 0.0));
        assert_eq!(Pace::new(0).next(Live::Idle), (1, 0.0));
    }

    #[test]
    fn beside_live_work_it_starts_low_and_climbs_while_the_latency_is_low() {
        let p = Pace::new(4);
        let t = Instant::now();
        let fast = Live::Latency(10 * MS);
        assert_eq!(p.next_at(fast, t), (1, 1.0), "starts at half duty");
        assert_eq!(p.next_at(fast, t + 100 * MS), (1, 1.0), "not due");
        assert_eq!(p.next_at(fast, t + 250 * MS), (1, 0.0));
        assert_eq!(p.next_at(fast, t + 500 * MS), (2, 0.0));
        assert_eq!(p.next_at(fast, t + 750 * MS), (3, 0.0));
        assert_eq!(p.next_at(fast, t + 1000 * MS), (4, 0.0));
        assert_eq!(p.next_at(fast, t + 1250 * MS), (4, 0.0), "the top");
        // Between half the target and the target: it holds.
        assert_eq!(p.next_at(Live::Latency(70 * MS), t + 2000 * MS), (4, 0.0));
    }

    #[test]
    fn over_the_target_it_halves_once_a_second_down_to_half_duty() {
        let p = Pace::new(4);
        let t = Instant::now();
        for i in 1..=4 {
            p.next_at(Live::Latency(MS), t + i * 250 * MS);
        }
        assert_eq!(p.next_at(Live::Latency(MS), t + 1500 * MS), (4, 0.0));
        let slow = Live::Latency(400 * MS);
        assert_eq!(p.next_at(slow, t + 1600 * MS), (2, 0.0), "level 4 → 2");
        assert_eq!(p.next_at(slow, t + 2000 * MS), (2, 0.0), "once a second");
        assert_eq!(p.next_at(slow, t + 2600 * MS), (1, 0.0), "2 → 1");
        assert_eq!(p.next_at(slow, t + 3600 * MS), (1, 1.0), "1 → 0");
        assert_eq!(p.next_at(slow, t + 4600 * MS), (1, 1.0), "the floor");
    }

    #[test]
    fn without_a_measure_it_holds() {
        let p = Pace::new(4);
        let t = Instant::now();
        assert_eq!(p.next_at(Live::Unmeasured, t), (1, 1.0));
        assert_eq!(
            p.next_at(Live::Unmeasured, t + 5000 * MS),
            (1, 1.0),
            "no climb"
        );
        assert_eq!(p.next_at(Live::Latency(MS), t + 5250 * MS), (1, 0.0));
        assert_eq!(
            p.next_at(Live::Unmeasured, t + 9000 * MS),
            (1, 0.0),
            "no fall"
        );
    }

    #[test]
    fn live_work_that_comes_back_starts_low_again() {
        let p = Pace::new(2);
        let t = Instant::now();
        for i in 1..=2 {
            p.next_at(Live::Latency(MS), t + i * 250 * MS);
        }
        assert_eq!(p.next_at(Live::Latency(MS), t + 750 * MS), (2, 0.0));
        assert_eq!(p.next_at(Live::Idle, t + 800 * MS), (2, 0.0));
        assert_eq!(p.next_at(Live::Latency(MS), t + 900 * MS), (1, 1.0));
    }
}
