//! The cluster token on gRPC: the metadata key, the server-side check and the client-side injector,
//! one implementation for the master and the peer service.

use std::sync::Arc;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Request, Status};

/// The metadata key that carries the cluster token on every call.
pub const TOKEN_METADATA: &str = "x-umbp-token";

/// A server interceptor that refuses every call without the cluster token, when one is configured.
#[derive(Debug, Clone, Default)]
pub struct TokenCheck {
    token: Option<Arc<str>>,
}

impl TokenCheck {
    /// Checks for `token`; `None` (or an empty token) lets every call through.
    pub fn new(token: Option<&str>) -> Self {
        Self { token: token.filter(|t| !t.is_empty()).map(Arc::from) }
    }
}

impl tonic::service::Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.token else { return Ok(request) };
        let given = request.metadata().get(TOKEN_METADATA).and_then(|v| v.to_str().ok());
        match given {
            Some(given) if constant_time_eq(given.as_bytes(), expected.as_bytes()) => Ok(request),
            Some(_) => Err(Status::unauthenticated("wrong cluster token")),
            None => Err(Status::unauthenticated("this cluster requires a token (x-umbp-token)")),
        }
    }
}

/// A client interceptor that adds the cluster token to every request.
#[derive(Debug, Clone, Default)]
pub struct TokenInjector(Option<MetadataValue<Ascii>>);

/// The cluster token cannot travel as gRPC metadata (it must be visible ASCII).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the cluster token must be visible ASCII to travel as gRPC metadata")]
pub struct InvalidToken;

impl TokenInjector {
    /// Adds `token` (nothing for `None`).
    ///
    /// # Errors
    /// [`InvalidToken`] when the token is not valid metadata.
    pub fn new(token: Option<&str>) -> Result<Self, InvalidToken> {
        token.map(|t| t.parse().map_err(|_| InvalidToken)).transpose().map(Self)
    }

    /// Puts the token on one request (for a call made without the interceptor).
    pub fn apply<T>(&self, request: &mut Request<T>) {
        if let Some(token) = &self.0 {
            request.metadata_mut().insert(TOKEN_METADATA, token.clone());
        }
    }
}

impl tonic::service::Interceptor for TokenInjector {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        self.apply(&mut request);
        Ok(request)
    }
}

/// Compares without an early exit on the first differing byte (the length still shows).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use tonic::service::Interceptor;

    use super::*;

    fn call_with(check: &mut TokenCheck, token: Option<&str>) -> Result<(), tonic::Code> {
        let mut request = Request::new(());
        TokenInjector::new(token).expect("a valid token").apply(&mut request);
        check.call(request).map(|_| ()).map_err(|s| s.code())
    }

    #[test]
    fn the_check_takes_the_right_token_and_refuses_the_rest() {
        let mut check = TokenCheck::new(Some("s3cret"));
        assert_eq!(call_with(&mut check, Some("s3cret")), Ok(()));
        assert_eq!(call_with(&mut check, Some("s3cret!")), Err(tonic::Code::Unauthenticated));
        assert_eq!(call_with(&mut check, Some("wrong")), Err(tonic::Code::Unauthenticated));
        assert_eq!(call_with(&mut check, None), Err(tonic::Code::Unauthenticated));
        let mut open = TokenCheck::new(None);
        assert_eq!(call_with(&mut open, None), Ok(()));
        assert_eq!(call_with(&mut open, Some("anything")), Ok(()));
        assert_eq!(call_with(&mut TokenCheck::new(Some("")), None), Ok(()), "an empty token is no token");
    }

    #[test]
    fn a_token_that_cannot_be_metadata_is_refused() {
        assert_eq!(TokenInjector::new(Some("line\nbreak")).map(|_| ()), Err(InvalidToken));
        assert!(TokenInjector::new(None).is_ok());
    }

    #[test]
    fn equal_means_equal_bytes_and_length() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
        assert!(constant_time_eq(b"", b""));
    }
}
