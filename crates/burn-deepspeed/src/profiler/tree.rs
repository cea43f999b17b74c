//! The module tree a profile is reported on: each module's path, type and parameters, read
//! with a [`ModuleVisitor`], and the flops of the operations attributed to it.

use std::collections::HashMap;
use std::time::Duration;

use burn::backend::Capture;
use burn::backend::capture::TensorId;
use burn::module::{ModuleVisitor, Param};
use burn::tensor::Tensor;
use serde::Serialize;

use super::rules::OpCost;

/// One module of a profile, with its children.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModuleProfile {
    /// The field or index naming it in its parent (`"model"` for the root).
    pub name: String,
    /// Its dotted path from the root (empty for the root).
    pub path: String,
    /// Its type (`Linear`, `LayerNorm`, `Vec`, …).
    pub kind: String,
    /// Parameters it holds, its children's included.
    pub params: u64,
    /// Multiply-accumulates of its forward, its children's included.
    pub macs: u64,
    /// Floating-point operations of its forward, its children's included.
    pub flops: u64,
    /// Measured forward latency (the root's: the whole forward; `None` where not measured).
    pub latency: Option<Duration>,
    /// Its submodules, in field order.
    pub children: Vec<ModuleProfile>,
}

impl ModuleProfile {
    /// Every module of the tree with its depth (the root at 0), depth first.
    pub fn walk(&self) -> Vec<(usize, &ModuleProfile)> {
        let mut out = Vec::new();
        fn go<'a>(m: &'a ModuleProfile, depth: usize, out: &mut Vec<(usize, &'a ModuleProfile)>) {
            out.push((depth, m));
            for c in &m.children {
                go(c, depth + 1, out);
            }
        }
        go(self, 0, &mut out);
        out
    }

    /// The module at `path` (`""`: the root).
    pub fn find(&self, path: &str) -> Option<&ModuleProfile> {
        self.walk()
            .into_iter()
            .map(|(_, m)| m)
            .find(|m| m.path == path)
    }
}

/// A module while the tree is built: its own (not its children's) figures.
#[derive(Debug, Default)]
pub(crate) struct Node {
    pub(crate) name: String,
    pub(crate) path: String,
    pub(crate) kind: Option<String>,
    pub(crate) own_params: u64,
    pub(crate) own: OpCost,
    /// A parameter's field (not a module): dropped from the tree when left.
    is_param: bool,
    pub(crate) parent: Option<usize>,
    pub(crate) children: Vec<usize>,
}

/// The tree of a module, read by [`Module::visit`](burn::module::Module::visit): nodes in
/// visit order (the root first), and the owner of each float parameter on a capture device,
/// by the captured tensor's id.
pub(crate) struct TreeBuilder {
    pub(crate) nodes: Vec<Node>,
    stack: Vec<usize>,
    pub(crate) owners: HashMap<TensorId, usize>,
}

impl TreeBuilder {
    pub(crate) fn new(root_kind: &str) -> Self {
        Self {
            nodes: vec![Node {
                name: "model".into(),
                kind: Some(root_kind.into()),
                ..Node::default()
            }],
            stack: vec![0],
            owners: HashMap::new(),
        }
    }
}

impl ModuleVisitor for TreeBuilder {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        // The container type names the module being entered *from*: the current node.
        let current = *self.stack.last().expect("the root is never left");
        let kind = container_type
            .split_once(':')
            .map_or(container_type, |(_, t)| t);
        self.nodes[current]
            .kind
            .get_or_insert_with(|| kind.to_string());
        let path = match self.nodes[current].path.as_str() {
            "" => name.to_string(),
            p => format!("{p}.{name}"),
        };
        let id = self.nodes.len();
        self.nodes.push(Node {
            name: name.to_string(),
            path,
            parent: Some(current),
            ..Node::default()
        });
        self.nodes[current].children.push(id);
        self.stack.push(id);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        let left = self.stack.pop().expect("entered before");
        // A field that turned out to be a parameter is not a module (its owner counted it),
        // nor is an empty `Option` or a field that holds no parameter at all.
        let node = &self.nodes[left];
        let empty = node.kind.is_none() && node.children.is_empty();
        if (node.is_param || empty)
            && let Some(parent) = node.parent
        {
            self.nodes[parent].children.retain(|&c| c != left);
        }
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        // The parameter's field was entered as a node: its owner is that node's parent.
        let field = *self.stack.last().expect("the root is never left");
        let owner = self.nodes[field].parent.unwrap_or(0);
        let tensor = param.val();
        self.nodes[field].is_param = true;
        self.nodes[owner].own_params += tensor.shape().num_elements() as u64;
        if let Ok(captured) = tensor.try_into_primitive::<Capture>() {
            self.owners.insert(captured.id(), owner);
        }
    }
}

/// The finished tree: each node's figures summed over its subtree; the root's latency is
/// `root_latency`, a scoped module's its scope's (`scoped`, by path). Also returns the
/// scopes whose path names no module of the tree.
pub(crate) fn finish(
    nodes: &[Node],
    root_latency: Duration,
    scoped: &HashMap<String, Duration>,
) -> (ModuleProfile, Vec<String>) {
    fn build(nodes: &[Node], i: usize, scoped: &HashMap<String, Duration>) -> ModuleProfile {
        let n = &nodes[i];
        let children: Vec<ModuleProfile> = n
            .children
            .iter()
            .map(|&c| build(nodes, c, scoped))
            .collect();
        ModuleProfile {
            name: n.name.clone(),
            path: n.path.clone(),
            kind: n.kind.clone().unwrap_or_else(|| "Param".into()),
            params: n.own_params + children.iter().map(|c| c.params).sum::<u64>(),
            macs: n.own.macs + children.iter().map(|c| c.macs).sum::<u64>(),
            flops: n.own.flops + children.iter().map(|c| c.flops).sum::<u64>(),
            latency: scoped.get(&n.path).copied(),
            children,
        }
    }
    let mut root = build(nodes, 0, scoped);
    root.latency = Some(root_latency);
    let paths: Vec<&str> = root.walk().iter().map(|(_, m)| m.path.as_str()).collect();
    let mut unmatched: Vec<String> = scoped
        .keys()
        .filter(|p| p.is_empty() || !paths.contains(&p.as_str()))
        .cloned()
        .collect();
    unmatched.sort();
    (root, unmatched)
}
