//! The `claimWorker:` options: how often the claim worker polls for new work, with and without
//! LISTEN/NOTIFY, and how many streams one poll takes, with their defaults. The ranges are
//! checked in `validate`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Upper bounds of the `claimWorker:` options (an hour between polls; streams per poll).
pub const MAX_POLLING_INTERVAL_MILLISECONDS: u64 = 3_600_000;
pub const MAX_STREAMS_PER_BATCH: u32 = 100_000;

/// Options of the claim worker, which polls for claimable work and feeds the drain consumers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ClaimWorkerOptions {
    /// Base interval between claim polls while LISTEN/NOTIFY is unavailable, in ms (default 250).
    #[schemars(range(min = 1, max = MAX_POLLING_INTERVAL_MILLISECONDS))]
    pub polling_interval_milliseconds: u64,
    /// Base interval between claim polls while LISTEN/NOTIFY is healthy, in ms; never below pollingIntervalMilliseconds (default 5000).
    #[schemars(range(min = 1, max = MAX_POLLING_INTERVAL_MILLISECONDS))]
    pub notify_healthy_polling_interval_milliseconds: u64,
    /// Cap of the interval while LISTEN/NOTIFY is healthy, which doubles with each consecutive empty poll, in ms; never below the base interval nor above a third of abandonStaleInstanceThresholdSeconds (default 10000). While NOTIFY is down every poll waits pollingIntervalMilliseconds.
    #[schemars(range(min = 1, max = MAX_POLLING_INTERVAL_MILLISECONDS))]
    pub polling_max_interval_milliseconds: u64,
    /// Unowned streams one claim poll takes, and streams it hands to the drain consumers beyond those already queued or being drained, at most (default 1000).
    #[schemars(range(min = 1, max = MAX_STREAMS_PER_BATCH))]
    pub max_streams_per_batch: u32,
    /// Keep polling on a timer while NOTIFY is healthy, in case a notification is lost (default true).
    pub enable_safety_net_poll: bool,
}

impl Default for ClaimWorkerOptions {
    fn default() -> Self {
        Self {
            polling_interval_milliseconds: 250,
            notify_healthy_polling_interval_milliseconds: 5000,
            polling_max_interval_milliseconds: 10_000,
            max_streams_per_batch: 1000,
            enable_safety_net_poll: true,
        }
    }
}
