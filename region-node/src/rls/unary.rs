//! `ShouldRateLimit` on the plaintext listener without tonic's codec: the
//! one unary call Envoy makes per request, read, decoded and answered here
//! by hand, with the messages generated from envoy's data-plane-api
//! (`envoy-types`, prost) as everywhere else.
//!
//! Why: behind hyper's HTTP/2 server, tonic's generated service still ran
//! its per-call machinery (`Grpc::unary`, the `Streaming` decoder and its
//! buffers, metadata maps, compression checks, a boxed encoder body, the
//! decision's future copied into a box) for a call whose whole body is one
//! small frame: 120.6 k instructions of region-node per RLS decision
//! against the HTTP check's 113.5 k, 107.4 k with this module
//! (`scripts/rls-profile`, BENCHMARKS.md §10). Here a call is: the body's
//! bytes (usually one DATA frame, not copied), the 5-byte gRPC prefix
//! checked, one `prost::Message::decode`, [`Service::should_rate_limit`],
//! the answer encoded into one buffer behind its prefix and sent as one
//! DATA frame and a `grpc-status: 0` trailer ([`Reply`]).
//!
//! What a caller sees is what tonic's generated server answered, status
//! codes and messages included: a compressed message (`grpc-encoding`
//! other than `identity`, or the compressed flag) is refused (no
//! compression is enabled), a message over tonic's default 4 MiB limit is
//! OUT_OF_RANGE, a body with no message, a cut message or a message that
//! does not decode is INTERNAL (the gRPC spec's code for a request that
//! does not parse), and a refused call is a trailers-only response
//! (`Status::into_http`). Nothing is decided, so nothing is charged, before
//! the request has decoded. One difference, for broken clients only: bytes
//! after the one message of this unary call are refused (INTERNAL) where
//! tonic decoded and dropped them.
//!
//! `grpc-timeout` is not read, as on this listener before (the generated
//! service has no timeout layer): Envoy enforces the call's deadline itself
//! (the ratelimit filter's `timeout`, then its `failure_mode_deny`), and a
//! decision is bounded by `node.store_timeout` and the admission queue.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use http::{HeaderMap, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use prost::Message;
use tonic::Status;

use super::service::Service;

/// The path of the call served here; every other path goes to the
/// generated services.
pub const PATH: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// tonic's default limit on a received message (what the generated server
/// applied): a request larger than this is refused before it is read.
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;

/// The gRPC message prefix: compressed flag (1 byte), length (4 bytes,
/// big endian).
const PREFIX: usize = 5;

const GRPC_CONTENT_TYPE: HeaderValue = HeaderValue::from_static("application/grpc");

/// Serves one `ShouldRateLimit` call.
pub async fn should_rate_limit<B>(service: &Service, req: http::Request<B>) -> http::Response<Reply>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let answer = match read(req).await {
        Ok(request) => service.should_rate_limit(request).await,
        Err(status) => Err(status),
    };
    match answer {
        Ok(response) => ok(&response),
        Err(status) => status.into_http(),
    }
}

/// The request message of the call, or the status that refuses it.
async fn read<B>(req: http::Request<B>) -> Result<RateLimitRequest, Status>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    if let Some(encoding) = req.headers().get("grpc-encoding") {
        if encoding.as_bytes() != b"identity" {
            let mut status = Status::unimplemented(format!(
                "Content is compressed with `{}` which isn't supported",
                String::from_utf8_lossy(encoding.as_bytes())
            ));
            status.metadata_mut().insert(
                "grpc-accept-encoding",
                tonic::metadata::MetadataValue::from_static("identity"),
            );
            return Err(status);
        }
    }
    let mut body = req.into_body();
    let mut message = Collected::Empty;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| Status::from_error(e.into()))?;
        // Trailers of a request carry nothing this call reads.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        message.push(data);
        // Refuse an oversized message before reading it all.
        if let Some(len) = message.declared_len() {
            if len > MAX_MESSAGE {
                return Err(Status::out_of_range(format!(
                    "Error, decoded message length too large: found {len} bytes, the limit is: {MAX_MESSAGE} bytes"
                )));
            }
            if message.len() > PREFIX + len {
                return Err(Status::internal(
                    "a unary call carries one message: bytes after it",
                ));
            }
        }
    }
    decode(message.bytes())
}

/// The message of a whole request body (prefix included).
fn decode(body: Bytes) -> Result<RateLimitRequest, Status> {
    if body.is_empty() {
        return Err(Status::internal("Missing request message."));
    }
    if body.len() < PREFIX {
        return Err(Status::internal("Unexpected EOF decoding stream."));
    }
    match body[0] {
        0 => {}
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ))
        }
        f => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1), while sending request"
            )))
        }
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    if body.len() != PREFIX + len {
        // Fewer bytes than the prefix announced (more were refused above).
        return Err(Status::internal("Unexpected EOF decoding stream."));
    }
    let mut message = body.slice(PREFIX..);
    RateLimitRequest::decode(&mut message).map_err(|e| Status::internal(e.to_string()))
}

/// The body's DATA frames so far. Envoy's request is one frame, kept as
/// it came (no copy); only a message split across frames is joined.
enum Collected {
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Collected {
    fn push(&mut self, data: Bytes) {
        if data.is_empty() {
            return;
        }
        *self = match std::mem::replace(self, Collected::Empty) {
            Collected::Empty => Collected::One(data),
            Collected::One(first) => {
                let mut joined = BytesMut::with_capacity(first.len() + data.len());
                joined.put(first);
                joined.put(data);
                Collected::Many(joined)
            }
            Collected::Many(mut joined) => {
                joined.put(data);
                Collected::Many(joined)
            }
        };
    }

    fn chunk(&self) -> &[u8] {
        match self {
            Collected::Empty => &[],
            Collected::One(b) => b,
            Collected::Many(b) => b,
        }
    }

    fn len(&self) -> usize {
        self.chunk().len()
    }

    /// The message length the prefix announces, once it is all here.
    fn declared_len(&self) -> Option<usize> {
        let c = self.chunk();
        (c.len() >= PREFIX).then(|| (&c[1..PREFIX]).get_u32() as usize)
    }

    fn bytes(self) -> Bytes {
        match self {
            Collected::Empty => Bytes::new(),
            Collected::One(b) => b,
            Collected::Many(b) => b.freeze(),
        }
    }
}

/// The OK answer: `content-type: application/grpc`, then the encoded
/// response behind its prefix, then `grpc-status: 0`.
fn ok(response: &RateLimitResponse) -> http::Response<Reply> {
    let len = response.encoded_len();
    let mut buf = BytesMut::with_capacity(PREFIX + len);
    buf.put_u8(0);
    buf.put_u32(len as u32);
    response
        .encode(&mut buf)
        .expect("the buffer was sized by encoded_len");
    let mut r = http::Response::new(Reply::Message(Some(buf.freeze())));
    r.headers_mut()
        .insert(http::header::CONTENT_TYPE, GRPC_CONTENT_TYPE);
    r
}

/// A response body of the plaintext listener: the hand-written call's
/// message and trailer, nothing (a trailers-only refusal: its status is in
/// the headers), or what a generated service answered.
pub enum Reply {
    /// The message (taken once sent), then the `grpc-status: 0` trailer.
    Message(Option<Bytes>),
    /// The trailer was sent, or the response is trailers-only.
    Done,
    Generated(tonic::body::Body),
}

impl Default for Reply {
    /// The body of a trailers-only response (`Status::into_http`).
    fn default() -> Reply {
        Reply::Done
    }
}

impl Body for Reply {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        match &mut *self {
            Reply::Message(message) => Poll::Ready(Some(Ok(match message.take() {
                Some(data) => Frame::data(data),
                None => {
                    *self = Reply::Done;
                    let mut trailers = HeaderMap::with_capacity(1);
                    trailers.insert("grpc-status", HeaderValue::from_static("0"));
                    Frame::trailers(trailers)
                }
            }))),
            Reply::Done => Poll::Ready(None),
            Reply::Generated(body) => Pin::new(body).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Reply::Message(_) => false,
            Reply::Done => true,
            Reply::Generated(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Reply::Message(Some(data)) => SizeHint::with_exact(data.len() as u64),
            Reply::Message(None) | Reply::Done => SizeHint::with_exact(0),
            Reply::Generated(body) => body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;

    fn framed(flag: u8, message: &[u8]) -> Vec<u8> {
        let mut v = vec![flag];
        v.extend_from_slice(&(message.len() as u32).to_be_bytes());
        v.extend_from_slice(message);
        v
    }

    fn request() -> RateLimitRequest {
        RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "tenant".into(),
                    value: "t".into(),
                }],
                ..Default::default()
            }],
            hits_addend: 2,
        }
    }

    /// A body of the given DATA frames.
    struct Frames(Vec<Bytes>);

    impl Body for Frames {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            Poll::Ready(if self.0.is_empty() {
                None
            } else {
                Some(Ok(Frame::data(self.0.remove(0))))
            })
        }
    }

    async fn read_frames(frames: Vec<Vec<u8>>) -> Result<RateLimitRequest, Status> {
        let body = Frames(frames.into_iter().map(Bytes::from).collect());
        read(http::Request::new(body)).await
    }

    #[tokio::test]
    async fn a_message_in_one_frame_or_split_decodes() {
        let whole = framed(0, &request().encode_to_vec());
        assert_eq!(read_frames(vec![whole.clone()]).await.unwrap(), request());
        let (a, b) = whole.split_at(3);
        let (b, c) = b.split_at(7);
        let split = vec![a.to_vec(), Vec::new(), b.to_vec(), c.to_vec()];
        assert_eq!(read_frames(split).await.unwrap(), request());
    }

    #[tokio::test]
    async fn malformed_bodies_are_refused_with_a_grpc_status() {
        let msg = request().encode_to_vec();
        let cases: Vec<(Vec<u8>, tonic::Code)> = vec![
            (Vec::new(), tonic::Code::Internal),
            (vec![0, 0, 0], tonic::Code::Internal),
            (framed(1, &msg), tonic::Code::Internal),
            (framed(7, &msg), tonic::Code::Internal),
            (framed(0, &msg)[..msg.len()].to_vec(), tonic::Code::Internal),
            ([framed(0, &msg), vec![0]].concat(), tonic::Code::Internal),
            (framed(0, &[0xff, 0xff, 0xff]), tonic::Code::Internal),
            (
                [vec![0], ((MAX_MESSAGE + 1) as u32).to_be_bytes().to_vec()].concat(),
                tonic::Code::OutOfRange,
            ),
        ];
        for (body, code) in cases {
            let e = read_frames(vec![body.clone()]).await.unwrap_err();
            assert_eq!(e.code(), code, "{body:?}: {e:?}");
        }
    }

    #[tokio::test]
    async fn a_compressed_call_is_unimplemented() {
        let mut req = http::Request::new(Frames(vec![Bytes::from(framed(
            0,
            &request().encode_to_vec(),
        ))]));
        req.headers_mut()
            .insert("grpc-encoding", HeaderValue::from_static("gzip"));
        let e = read(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unimplemented);
    }

    #[tokio::test]
    async fn the_answer_is_one_message_then_an_ok_trailer() {
        let response = RateLimitResponse {
            overall_code: 1,
            ..Default::default()
        };
        let r = ok(&response);
        assert_eq!(r.headers()["content-type"], "application/grpc");
        let collected = r.into_body().collect().await.unwrap();
        let trailers = collected.trailers().cloned().unwrap();
        assert_eq!(trailers["grpc-status"], "0");
        let body = collected.to_bytes();
        assert_eq!(body[0], 0);
        assert_eq!(body[1..PREFIX], (body.len() as u32 - 5).to_be_bytes());
        assert_eq!(
            RateLimitResponse::decode(&body[PREFIX..]).unwrap(),
            response
        );
        let refused: http::Response<Reply> = Status::internal("x").into_http();
        assert!(refused.body().is_end_stream());
        assert_eq!(refused.headers()["grpc-status"], "13");
    }
}
