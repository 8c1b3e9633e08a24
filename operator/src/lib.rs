//! perspective-operator: turns `PerspectiveDeployment` resources into a migration Job and a
//! worker StatefulSet, and reports readiness, lag and dead letters as status.
