//! How hard a catch-up (backfill, rebuild, blue/green build) runs its chunks.
//!
//! Without live work (the claim loop found none for a while) it runs at full speed: a chunk loop
//! per drain consumer. Beside live work it runs as fast as the live side allows, by two signals
//! of the perspectives it is not catching up:
//! - their worst apply latency of the last second: the live read models' users wait;
//! - their apply rate against a reference (the rate when the catch-up last ran at its floor, or
//!   the best since): producers that append as fast as the database lets them do not show in the
//!   latency, only in how many events a second reach the live perspectives.
//!
//! The pace goes up a step while the latency stays under half of [`LIVE_LATENCY_TARGET`] and the
//! rate at [`STEP_UP_SHARE`] of the reference or more (every 250 ms until it first had to halve,
//! every 2 s after that), and is halved when the latency goes over the target or the rate under
//! [`STEP_DOWN_SHARE`] (additive increase, multiplicative decrease, as TCP's congestion window), so
//! a catch-up takes what the machine has to spare and gives it back within a second or two. It
//! never goes below one chunk loop at half duty (a catch-up must end; a lower floor made a custom
//! runner's queued backfill crawl), so it cannot always keep the live side at its goals. While live
//! work exists but nothing was applied in the last second there is no measure: it holds.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::engine::live_apply::LiveMeasure;

/// The live apply latency (append → applied, the worst of the last second) over which a
/// catch-up beside live work slows down: the README's "Beside live work a catch-up takes what
/// the live perspectives leave". The goal for a live perspective beside a catch-up is a p99
/// under 250 ms; the worst of each second is above its p99, so 200 ms keeps under it. (At 100 ms
/// the pace never left its floor beside 500 live events/s on 2 cores, where the live p99 of each
/// second was 40–95 ms even at the floor: a blue/green build ran at 11–30% of the steady state.)
pub const LIVE_LATENCY_TARGET: Duration = Duration::from_millis(200);
/// Under this share of the reference rate the pace halves: the catch-up takes the producers'
/// share of the machine (issue 10's goal: appends beside a backfill at 80% of their rate
/// without one; the floor itself costs a few percent).
pub const STEP_DOWN_SHARE: f64 = 0.85;
/// From this share of the reference rate the pace may climb. Between the two shares it holds.
pub const STEP_UP_SHARE: f64 = 0.92;
/// At most one step up per this long until the first halving: a step's effect shows in the
/// latency within it.
const STEP_UP_INTERVAL: Duration = Duration::from_millis(250);
/// At most one step up per this long once the pace has had to halve: the rate window (two
/// seconds) must have seen the last step before the next. Climbing every 250 ms, the rate fell
/// under its share only after the pace had reached the top, and the pace swung between the
/// floor and the top: beside a durable backfill, producers asking 1 000 events a second reached
/// 568–779 (as in a slow start and congestion avoidance, but with halvings as the losses).
const CAUTIOUS_STEP_UP_INTERVAL: Duration = Duration::from_secs(2);
/// At most one halving per this long: the latency window (a second) must forget the slow
/// events of before the last halving first.
const STEP_DOWN_INTERVAL: Duration = Duration::from_secs(1);
/// After this long at the floor the rate there becomes the reference (the rate window, two
/// seconds, no longer holds the time above it). So a live load that fell for its own reasons
/// does not hold the catch-up at its floor for good.
const FLOOR_SETTLE: Duration = Duration::from_secs(2);
/// Where the pace starts when live work appears: the floor, one chunk loop at half duty.
const START_LEVEL: u32 = 0;

/// What the live perspectives show, for the pace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Live {
    /// No live work (the claim loop found none for a while): full speed.
    Idle,
    /// Live work, but nothing applied in the last second: no measure, hold.
    Unmeasured,
    /// What the live perspectives applied lately.
    Measured(LiveMeasure),
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
    /// The live rate the catch-up must not push the producers' below (events a second).
    reference: Option<f64>,
    /// Since when the pace is at its floor.
    at_floor: Instant,
}

impl Pace {
    /// A pace for a worker with `drain_consumers` drain consumers.
    pub(crate) fn new(drain_consumers: u32) -> Pace {
        Pace {
            consumers: drain_consumers.max(1),
            state: Mutex::new(State::start(false, Instant::now())),
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
    /// when the live perspectives' latency or rate calls for one and one is due.
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
            *s = State::start(true, now);
        }
        let Live::Measured(m) = live else {
            return self.setting(s.level);
        };
        // The first measure covers the last two seconds, mostly before this catch-up ran
        // beside the live work (or it ran at its floor): the rate to keep.
        let reference = match s.reference {
            Some(r) if s.level > 0 || now - s.at_floor < FLOOR_SETTLE => r.max(m.rate),
            _ => m.rate,
        };
        s.reference = Some(reference);
        let due = |at: Option<Instant>, every: Duration| at.is_none_or(|at| now - at >= every);
        if m.worst > LIVE_LATENCY_TARGET || m.rate < STEP_DOWN_SHARE * reference {
            if s.level > 0 && due(s.stepped_down, STEP_DOWN_INTERVAL) {
                s.level /= 2;
                s.stepped_down = Some(now);
                s.stepped_up = Some(now);
                if s.level == 0 {
                    s.at_floor = now;
                }
            }
        } else if m.worst < LIVE_LATENCY_TARGET / 2
            && m.rate >= STEP_UP_SHARE * reference
            && s.level < self.top()
            && due(s.stepped_up, s.step_up_interval())
        {
            s.level += 1;
            s.stepped_up = Some(now);
        }
        self.setting(s.level)
    }
}

impl State {
    /// Quick steps up until the pace first had to halve beside this live work, then cautious
    /// ones.
    fn step_up_interval(&self) -> Duration {
        match self.stepped_down {
            None => STEP_UP_INTERVAL,
            Some(_) => CAUTIOUS_STEP_UP_INTERVAL,
        }
    }

    fn start(live: bool, now: Instant) -> State {
        State {
            level: START_LEVEL,
            live,
            stepped_up: Some(now),
            stepped_down: None,
            reference: None,
            at_floor: now,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    /// Live perspectives applying 100 events a second, the worst `latency` after its append.
    fn lat(latency: Duration) -> Live {
        at(latency, 100.0)
    }

    fn at(worst: Duration, rate: f64) -> Live {
        Live::Measured(LiveMeasure { worst, rate })
    }

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
        let fast = lat(10 * MS);
        assert_eq!(p.next_at(fast, t), (1, 1.0), "starts at half duty");
        assert_eq!(p.next_at(fast, t + 100 * MS), (1, 1.0), "not due");
        assert_eq!(p.next_at(fast, t + 250 * MS), (1, 0.0));
        assert_eq!(p.next_at(fast, t + 500 * MS), (2, 0.0));
        assert_eq!(p.next_at(fast, t + 750 * MS), (3, 0.0));
        assert_eq!(p.next_at(fast, t + 1000 * MS), (4, 0.0));
        assert_eq!(p.next_at(fast, t + 1250 * MS), (4, 0.0), "the top");
        // Between half the target and the target: it holds.
        assert_eq!(p.next_at(lat(70 * MS), t + 2000 * MS), (4, 0.0));
    }

    #[test]
    fn over_the_target_it_halves_once_a_second_down_to_half_duty() {
        let p = Pace::new(4);
        let t = Instant::now();
        for i in 1..=4 {
            p.next_at(lat(MS), t + i * 250 * MS);
        }
        assert_eq!(p.next_at(lat(MS), t + 1500 * MS), (4, 0.0));
        let slow = lat(400 * MS);
        assert_eq!(p.next_at(slow, t + 1600 * MS), (2, 0.0), "level 4 → 2");
        assert_eq!(p.next_at(slow, t + 2000 * MS), (2, 0.0), "once a second");
        assert_eq!(p.next_at(slow, t + 2600 * MS), (1, 0.0), "2 → 1");
        assert_eq!(p.next_at(slow, t + 3600 * MS), (1, 1.0), "1 → 0");
        assert_eq!(p.next_at(slow, t + 4600 * MS), (1, 1.0), "the floor");
    }

    #[test]
    fn once_it_had_to_halve_it_climbs_a_step_per_rate_window() {
        let p = Pace::new(4);
        let t = Instant::now();
        let ms = |n: u32| t + n * MS;
        for i in 0..=4 {
            p.next_at(lat(MS), ms(i * 250));
        }
        assert_eq!(
            p.next_at(lat(MS), ms(1100)),
            (4, 0.0),
            "quick steps to the top"
        );
        assert_eq!(p.next_at(lat(400 * MS), ms(1200)), (2, 0.0), "halved");
        assert_eq!(p.next_at(lat(MS), ms(1500)), (2, 0.0));
        assert_eq!(
            p.next_at(lat(MS), ms(3000)),
            (2, 0.0),
            "not 2 s since the last step"
        );
        assert_eq!(p.next_at(lat(MS), ms(3200)), (3, 0.0));
        assert_eq!(p.next_at(lat(MS), ms(3500)), (3, 0.0), "not 2 s since");
        assert_eq!(p.next_at(lat(MS), ms(5200)), (4, 0.0));
        // Live work that comes back after an idle spell climbs quickly again.
        assert_eq!(p.next_at(Live::Idle, ms(5300)), (4, 0.0));
        assert_eq!(p.next_at(lat(MS), ms(5400)), (1, 1.0));
        assert_eq!(p.next_at(lat(MS), ms(5650)), (1, 0.0));
        assert_eq!(p.next_at(lat(MS), ms(5900)), (2, 0.0));
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
        assert_eq!(p.next_at(lat(MS), t + 5250 * MS), (1, 0.0));
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
            p.next_at(lat(MS), t + i * 250 * MS);
        }
        assert_eq!(p.next_at(lat(MS), t + 750 * MS), (2, 0.0));
        assert_eq!(p.next_at(Live::Idle, t + 800 * MS), (2, 0.0));
        assert_eq!(p.next_at(lat(MS), t + 900 * MS), (1, 1.0));
    }

    #[test]
    fn a_rate_that_falls_under_its_share_of_the_reference_halves_the_pace() {
        let p = Pace::new(4);
        let t = Instant::now();
        let ms = |n: u32| t + n * MS;
        // Producers at 1 000 events a second before and as the catch-up starts.
        assert_eq!(p.next_at(at(MS, 1000.0), ms(0)), (1, 1.0));
        for i in 1..=3 {
            p.next_at(at(MS, 1000.0), ms(i * 250));
        }
        assert_eq!(p.next_at(at(MS, 950.0), ms(1000)), (4, 0.0), "95%: climbs");
        // 90%: holds (under the share to climb, over the share to fall).
        assert_eq!(p.next_at(at(MS, 900.0), ms(1500)), (4, 0.0));
        assert_eq!(p.next_at(at(MS, 800.0), ms(1600)), (2, 0.0), "80%: halves");
        assert_eq!(
            p.next_at(at(MS, 800.0), ms(2000)),
            (2, 0.0),
            "once a second"
        );
        assert_eq!(p.next_at(at(MS, 800.0), ms(2600)), (1, 0.0));
        assert_eq!(p.next_at(at(MS, 800.0), ms(3600)), (1, 1.0), "the floor");
        // Still 80% at the floor: the producers' rate fell for their own reasons. After two
        // seconds there it becomes the reference, and the pace climbs again.
        assert_eq!(p.next_at(at(MS, 800.0), ms(5000)), (1, 1.0), "settling");
        assert_eq!(p.next_at(at(MS, 800.0), ms(5700)), (1, 0.0), "climbs");
        // A step per rate window now: it had to halve.
        assert_eq!(p.next_at(at(MS, 790.0), ms(6000)), (1, 0.0));
        assert_eq!(p.next_at(at(MS, 790.0), ms(7700)), (2, 0.0));
    }

    #[test]
    fn a_higher_rate_raises_the_reference() {
        let p = Pace::new(4);
        let t = Instant::now();
        let ms = |n: u32| t + n * MS;
        p.next_at(at(MS, 500.0), ms(0));
        assert_eq!(p.next_at(at(MS, 1000.0), ms(250)), (1, 0.0));
        assert_eq!(
            p.next_at(at(MS, 880.0), ms(500)),
            (1, 0.0),
            "88% of the new reference: no climb"
        );
        assert_eq!(p.next_at(at(MS, 840.0), ms(1300)), (1, 1.0), "84%: halves");
    }
}
