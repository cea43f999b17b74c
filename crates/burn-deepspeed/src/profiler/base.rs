//! [`get_model_profile`]: a module's forward captured as an operation graph, each operation
//! counted by DeepSpeed's rules and attributed to a module, and the forward timed on the
//! module's own device.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use burn::backend::capture::TensorId;
use burn::module::Module;
use burn::tensor::Device;
use burn_deepspeed_strategies::comm::catch_panic;
use burn_ir::{FloatOperationIr, NumericOperationIr, OperationIr, TensorIr};
use serde::Serialize;

use super::graph::op_cost;
use super::rules::OpCost;
use super::scope::timed_scopes;
use super::tree::{ModuleProfile, TreeBuilder, finish};
use crate::config::FlopsProfilerConfig;
use crate::{DeepSpeedError, Result};

/// What to print and how to count the backward pass (DeepSpeed's `flops_profiler` section,
/// and `get_model_profile`'s arguments).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProfileOptions {
    /// Depth of the module tree printed (−1: every depth).
    pub module_depth: i64,
    /// Modules listed per depth in the aggregated profile.
    pub top_modules: usize,
    /// Print the module tree, not only the summary and the aggregated profile.
    pub detailed: bool,
    /// Forward passes run before the timed one.
    pub warm_up: usize,
    /// Extra forwards recomputed in backward (activation checkpointing): the backward counts
    /// `2 + recompute_fwd_factor` times the forward's flops, as DeepSpeed's does.
    pub recompute_fwd_factor: f64,
}

impl Default for ProfileOptions {
    fn default() -> Self {
        Self {
            module_depth: -1,
            top_modules: 1,
            detailed: true,
            warm_up: 1,
            recompute_fwd_factor: 0.0,
        }
    }
}

impl From<&FlopsProfilerConfig> for ProfileOptions {
    fn from(c: &FlopsProfilerConfig) -> Self {
        Self {
            module_depth: c.module_depth,
            top_modules: c.top_modules as usize,
            detailed: c.detailed,
            warm_up: 1,
            recompute_fwd_factor: c.recompute_fwd_factor,
        }
    }
}

/// A module's forward profile: the module tree with parameters, MACs and flops, the
/// measured forward latency, and the totals per kind of operation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelProfile {
    /// The module tree.
    pub root: ModuleProfile,
    /// Forward time on the module's device, measured (after the warm-up passes), with the
    /// [`scope`](super::scope)s synchronising the device around their modules.
    pub fwd_latency: Duration,
    /// MACs and flops per kind of operation (`linear`, `matmul`, `softmax`, …).
    pub by_op: BTreeMap<String, OpCost>,
    /// Operations captured in the forward (every kind, free ones included).
    pub ops_captured: usize,
    /// The options it was made with.
    pub options: ProfileOptions,
    /// Paths of [`scope`](super::scope)s run in the forward that name no module of the tree
    /// (a misspelt field, or a module's scopes when it is profiled without its parent's);
    /// their times are not reported.
    pub unmatched_scopes: Vec<String>,
    /// The training step's measured times, when the engine made the profile.
    pub step: Option<StepFigures>,
}

/// A training step's measured times, which the engine's profile reports beside the
/// forward's (DeepSpeed's `fwd latency`, `bwd latency`, `iter latency`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepFigures {
    /// Time in forward passes over the step's micro-batches (`None`: not told apart).
    pub fwd: Option<Duration>,
    /// Time in backward passes over the step's micro-batches.
    pub bwd: Option<Duration>,
    /// The whole step.
    pub step: Duration,
    /// Samples of the step, every rank's.
    pub samples: u64,
    /// Micro-batches per rank in the step.
    pub micro_batches: u64,
}

impl ModelProfile {
    /// Forward flops.
    pub fn flops(&self) -> u64 {
        self.root.flops
    }
    /// Forward multiply-accumulates.
    pub fn macs(&self) -> u64 {
        self.root.macs
    }
    /// Parameters.
    pub fn params(&self) -> u64 {
        self.root.params
    }
    /// Backward flops as DeepSpeed counts them: `(2 + recompute_fwd_factor)` forwards.
    pub fn bwd_flops(&self) -> u64 {
        ((2.0 + self.options.recompute_fwd_factor) * self.flops() as f64) as u64
    }
    /// Achieved forward FLOPS (flops per second of the measured forward).
    pub fn fwd_flops_per_s(&self) -> f64 {
        self.flops() as f64 / self.fwd_latency.as_secs_f64().max(1e-12)
    }
    /// The profile with a training step's times.
    pub fn with_step(mut self, step: StepFigures) -> Self {
        self.step = Some(step);
        self
    }

    /// The profile as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a profile serializes")
    }
}

/// Profiles `model`'s forward as DeepSpeed's `get_model_profile` does: returns its flops,
/// MACs and parameters per module (print them with [`ModelProfile::report`]).
///
/// `forward` runs the model on a device it is given: build the input there (e.g.
/// `Tensor::zeros([8, 256], device)`, DeepSpeed's `input_shape`) and return the output. It
/// runs twice over: on a **capture device**, where Burn records every operation with its
/// shapes without executing it, and on the model's own device, timed, after `warm_up`
/// passes.
///
/// Each recorded operation is counted by DeepSpeed's rules ([`rules`](super::rules)) and
/// attributed to a module: an operation that reads a module's parameter belongs to that
/// module; one that reads none (a residual add, the attention's scores) belongs to the parent
/// of the module whose parameter the forward read last. The totals do not depend on this
/// attribution; which module a parameter-free operation lands in may differ from
/// DeepSpeed's, whose hooks see each module's forward call (Burn has no such hook).
///
/// Latency is measured for the whole forward, and for each module whose forward the model
/// runs inside a [`scope`](super::scope) (Burn 0.22 has no forward hook to time every module
/// as DeepSpeed does); a scope that names no module of the tree is listed in
/// [`ModelProfile::unmatched_scopes`] and in the printed profile.
///
/// The forward must not read tensor values (a data-dependent branch, MoE routing): a
/// captured tensor has none, and the profile fails with the reason. Custom operations of
/// this crate (ZeRO-3 gathers, tensor-parallel collectives, activation checkpoints, the MoE
/// all-to-all) run on real devices only: profile the plain, unsharded model.
pub fn get_model_profile<M, F, R>(
    model: &M,
    forward: F,
    options: &ProfileOptions,
) -> Result<ModelProfile>
where
    M: Module,
    F: Fn(&M, &Device) -> R,
{
    let plain = model.valid();
    let device = plain
        .devices()
        .into_iter()
        .next()
        .ok_or_else(|| profile_error("the model has no parameters on any device".into()))?;
    // The capture first: a forward that cannot be captured fails before anything runs.
    let (nodes, owners, ops) = capture(&plain, &forward)?;
    let mut nodes = nodes;
    let mut by_op: BTreeMap<String, OpCost> = BTreeMap::new();
    let mut owners = owners;
    let mut products: HashMap<TensorId, usize> = HashMap::new();
    let mut current = 0usize;
    for op in &ops {
        let owner = op.inputs().find_map(|t| owners.get(&t.id).copied());
        // A pure transform of a module's parameters (a reshape, a transpose, a cast of the
        // weight) yields the module's tensors too: the product that reads them is its own.
        if let Some(o) = owner
            && op.inputs().all(|t| owners.contains_key(&t.id))
        {
            for out in op.outputs() {
                owners.insert(out.id, o);
            }
        }
        let at = match owner {
            Some(o) => {
                current = nodes[o].parent.unwrap_or(o);
                o
            }
            None => current,
        };
        if let OperationIr::Float(_, FloatOperationIr::Matmul(m)) = op {
            products.insert(m.out.id, at);
        }
        // A module's parameter added to that module's own product is a linear layer's
        // bias, which DeepSpeed's `linear` rule does not count (Burn's `Linear` is a
        // matmul and an add).
        if let OperationIr::NumericFloat(_, NumericOperationIr::Add(add)) = op {
            let bias = |p: &TensorIr, q: &TensorIr| {
                owners.get(&p.id) == Some(&at) && products.get(&q.id) == Some(&at)
            };
            if bias(&add.lhs, &add.rhs) || bias(&add.rhs, &add.lhs) {
                continue;
            }
        }
        if let Some((kind, cost)) = op_cost(op) {
            nodes[at].own += cost;
            *by_op.entry(kind.to_string()).or_default() += cost;
        }
    }
    let timed = || -> Result<Duration> {
        let start = Instant::now();
        // The output lives until the device is synchronised: a lazy backend could
        // otherwise skip work whose result was dropped.
        let out = forward(&plain, &device);
        device
            .sync()
            .map_err(|e| profile_error(format!("the device failed: {e:?}")))?;
        let took = start.elapsed();
        drop(out);
        Ok(took)
    };
    for _ in 0..options.warm_up {
        timed()?;
    }
    let (fwd_latency, scoped) = timed_scopes(timed);
    let fwd_latency = fwd_latency?;
    let (root, unmatched_scopes) = finish(&nodes, fwd_latency, &scoped);
    Ok(ModelProfile {
        root,
        unmatched_scopes,
        fwd_latency,
        by_op,
        ops_captured: ops.len(),
        options: options.clone(),
        step: None,
    })
}

type Captured = (
    Vec<super::tree::Node>,
    HashMap<TensorId, usize>,
    Vec<OperationIr>,
);

/// `model`'s tree and forward, recorded on a fresh capture device.
fn capture<M, F, R>(model: &M, forward: &F) -> Result<Captured>
where
    M: Module,
    F: Fn(&M, &Device) -> R,
{
    let device = Device::capture();
    let kind = std::any::type_name::<M>()
        .rsplit("::")
        .next()
        .unwrap_or("Model")
        .split('<')
        .next()
        .unwrap_or("Model")
        .to_string();
    let mut tree = None;
    // Caught here, and so not the end of an MPI job (see `comm::catch_panic`).
    let graph = catch_panic(|| {
        device.capture_scope(|scope| {
            let captured = model.clone().to_device(&device);
            let mut builder = TreeBuilder::new(&kind);
            captured.visit(&mut builder);
            tree = Some(builder);
            let out = forward(&captured, &device);
            drop(out);
            scope.complete([], [])
        })
    })
    .map_err(|panic| {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        profile_error(format!(
            "the forward cannot be captured ({why}); it must not read tensor values, and \
             this crate's custom operations run on real devices only (profile the plain, \
             unsharded model)"
        ))
    })?
    .map_err(|e| profile_error(format!("capture failed: {e}")))?;
    let builder = tree.ok_or_else(|| profile_error("the capture did not run".into()))?;
    Ok((builder.nodes, builder.owners, graph.graph.operations))
}

fn profile_error(why: String) -> DeepSpeedError {
    DeepSpeedError::Data(format!("flops profiler: {why}"))
}
