//! Wire protocols, pure: bytes in, typed replies out; requests appended to a buffer.

pub mod memcache;
pub mod resp;
