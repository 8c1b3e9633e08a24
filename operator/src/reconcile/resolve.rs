//! What a deployment's spec resolves to before anything is read or built: the worker image
//! (the operator's default when the spec names none), the worker config and its hash, the
//! migration target and the ConfigMap's name. Pure.

use kube::ResourceExt;
use perspective_worker::config::Config;

use super::context::Options;
use crate::config_map;
use crate::crd::PerspectiveDeployment;
use crate::labels;
use crate::migration_job::{self, MigrationTarget};

/// The resolved spec of one deployment.
#[derive(Debug, Clone)]
pub struct Resolved {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `namespace/name`, the key of the deployment's database pool.
    pub key: String,
    pub image: String,
    pub config: Config,
    pub config_hash: String,
    pub target: MigrationTarget,
    pub config_map_name: String,
    /// Pods get AppArmor `RuntimeDefault` (the operator's `--apparmor-runtime-default`).
    pub app_armor_runtime_default: bool,
}

impl Resolved {
    pub fn new(pd: &PerspectiveDeployment, namespace: &str, options: &Options) -> Resolved {
        let name = pd.name_any();
        let spec = &pd.spec;
        let image = options.image_of(spec);
        let config = spec.worker_config();
        let (_, config_hash) = config_map::render(&config);
        let target = migration_job::target(&name, spec, &image);
        let config_map_name = labels::config_map_name(&name, &config_hash);
        Resolved {
            key: format!("{namespace}/{name}"),
            namespace: namespace.to_owned(),
            name,
            image,
            config,
            config_hash,
            target,
            config_map_name,
            app_armor_runtime_default: options.app_armor_runtime_default,
        }
    }
}
