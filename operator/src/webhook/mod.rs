//! The validating admission webhook: `kubectl apply` of an invalid `PerspectiveDeployment`
//! fails at once, with the message the reconciler would otherwise report as `Degraded`
//! `InvalidSpec` (the same check, [`crate::reconcile::validate::spec_problems`]).
//!
//! - [`review`]: AdmissionReview in, AdmissionReview out — pure;
//! - [`tls`]: the serving certificate, read from a mounted Secret and reloaded when it changes;
//! - [`server`]: the HTTPS endpoint.

pub mod review;
pub mod server;
pub mod tls;
