//! Every message of the specification, with its field names.

mod claim;
mod continuation;
mod enums;
mod job;
mod membership;
mod processing;
mod registration;
mod result;
mod stream;

pub use claim::*;
pub use continuation::*;
pub use enums::*;
pub use job::*;
pub use membership::*;
pub use processing::*;
pub use registration::*;
pub use result::*;
pub use stream::*;
