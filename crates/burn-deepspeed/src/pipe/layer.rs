//! What a pipelined model provides: its layers (each a Burn module) and a batch that knows
//! its loss.

use burn::module::Module;
use burn::tensor::Tensor;

/// The input of a layer: the micro-batch itself for the first layer of the model, the
/// previous layer's output for every other layer.
// A tensor handle is large next to a reference, but the input is built once per layer call
// and moved, never stored: boxing it would cost an allocation per layer for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum LayerInput<'a, B> {
    /// The micro-batch (first layer of the whole model only).
    Batch(&'a B),
    /// Hidden states from the previous layer, `[batch, seq, features]`.
    Hidden(Tensor<3>),
}

impl<B> LayerInput<'_, B> {
    /// The hidden states; panics with the layer's name when this is the first layer's batch
    /// (a model whose first layer does not read the batch is built wrong).
    pub fn hidden(self, layer: &str) -> Tensor<3> {
        match self {
            LayerInput::Hidden(h) => h,
            LayerInput::Batch(_) => panic!(
                "layer `{layer}` got the micro-batch, not hidden states: only the first layer may read the batch"
            ),
        }
    }
}

/// One layer of a pipelined model (DeepSpeed's `LayerSpec`): a Burn module that maps the
/// previous layer's output (or, for the first layer, the micro-batch) to hidden states.
///
/// Activations crossing a stage boundary are `Tensor<3>` of f32; they are sent as their values
/// and the receiving stage differentiates with respect to them.
pub trait PipeLayer<B>: Module {
    /// Runs the layer.
    fn forward(&self, input: LayerInput<'_, B>) -> Tensor<3>;

    /// The layer's type name, matched by `partition_method = "type:REGEX"`.
    fn type_name(&self) -> String;

    /// Layers that return the same key share their weights (DeepSpeed's `TiedLayerSpec`, e.g.
    /// an embedding reused as the output head): each holds a copy, the copies start equal, and
    /// their gradients are summed across the stages that hold them (`ReduceTiedGrads`), so the
    /// copies stay equal. The copies must have the same parameter shapes in the same order.
    fn tie_key(&self) -> Option<String> {
        None
    }
}

/// A micro-batch of a pipelined model: the first stage feeds it to the first layer, the last
/// stage turns the last layer's output into the loss.
pub trait PipeBatch {
    /// The micro-batch's mean loss, from the output of the last layer.
    fn loss(&self, output: Tensor<3>) -> Tensor<1>;
}
