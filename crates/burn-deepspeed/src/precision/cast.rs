//! The working copy of a model in a 16-bit dtype.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{FloatDType, Tensor};

/// `module` with every float parameter cast to `dtype` (f16 or bf16 for mixed precision).
/// Each parameter keeps its id, so gradients and optimizer state still find it, and stays a
/// leaf of the autodiff graph (Burn keeps gradients of leaves only): the cast is detached,
/// and a parameter that required a gradient still does.
pub fn cast_module<M: Module>(module: M, dtype: FloatDType) -> M {
    struct Cast(FloatDType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|t| {
                let grad = t.is_require_grad();
                let t = t.cast(dtype).detach();
                if grad { t.require_grad() } else { t }
            })
        }
    }
    module.map(&mut Cast(dtype))
}
