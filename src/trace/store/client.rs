//! The object-store client: one store per URL scheme, every answer it
//! would hold whole bounded in size.

use std::sync::Arc;

use futures_util::StreamExt;
use object_store::list::PaginatedListStore;
use object_store::{ClientConfigKey, ObjectStore};

use crate::trace::store::limits::{Limits, MAX_ANSWER_BYTES, MAX_ERROR_ANSWER_BYTES};

/// The object-store client's HTTP service with every answer it would hold
/// whole bounded: a ranged GET to its range, an error to
/// [`MAX_ERROR_ANSWER_BYTES`], any other GET with a query (a listing page)
/// to [`MAX_ANSWER_BYTES`]. A whole-object GET (the copy of an object
/// without an ETag) is streamed and checked against the listed size.
#[derive(Debug)]
struct Bounded(object_store::client::HttpClient);

#[derive(Debug, Default)]
struct BoundedConnector;

impl object_store::client::HttpConnector for BoundedConnector {
    fn connect(
        &self,
        options: &object_store::ClientOptions,
    ) -> object_store::Result<object_store::client::HttpClient> {
        let inner = object_store::client::ReqwestConnector::default().connect(options)?;
        Ok(object_store::client::HttpClient::new(Bounded(inner)))
    }
}

/// A body longer than a [`Bounded`] answer may be.
#[derive(Debug)]
struct TooLong(u64);

impl std::fmt::Display for TooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the answer is longer than the {} bytes kvtrail accepts for it",
            self.0
        )
    }
}

impl std::error::Error for TooLong {}

#[async_trait::async_trait]
impl object_store::client::HttpService for Bounded {
    async fn call(
        &self,
        req: object_store::client::HttpRequest,
    ) -> std::result::Result<object_store::client::HttpResponse, object_store::client::HttpError>
    {
        use http_body_util::BodyExt;
        let range = req
            .headers()
            .get(http::header::RANGE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("bytes="))
            .and_then(|v| v.split_once('-'))
            .and_then(|(a, b)| Some(b.parse::<u64>().ok()?.saturating_sub(a.parse().ok()?) + 1));
        let listing = req.method() == http::Method::GET && req.uri().query().is_some();
        let res = self.0.execute(req).await?;
        let cap = if res.status().is_client_error() || res.status().is_server_error() {
            MAX_ERROR_ANSWER_BYTES
        } else if let Some(n) = range {
            n
        } else if listing {
            MAX_ANSWER_BYTES
        } else {
            return Ok(res);
        };
        let (parts, body) = res.into_parts();
        let mut seen = 0u64;
        let body = http_body_util::StreamBody::new(body.into_data_stream().map(move |chunk| {
            let chunk = chunk?;
            seen += chunk.len() as u64;
            if seen > cap {
                return Err(object_store::client::HttpError::new(
                    object_store::client::HttpErrorKind::Decode,
                    TooLong(cap),
                ));
            }
            Ok(http_body::Frame::data(chunk))
        }));
        Ok(object_store::client::HttpResponse::from_parts(
            parts,
            object_store::client::HttpResponseBody::new(body),
        ))
    }
}

/// The store of `url`, and its lister (none for HTTP(S)).
type Built = (Arc<dyn ObjectStore>, Option<Arc<dyn PaginatedListStore>>);

pub(crate) fn build_store(url: &url::Url, limits: &Limits) -> object_store::Result<Built> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
    use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
    use object_store::http::HttpBuilder;
    let client = limits.client();
    Ok(match url.scheme() {
        "s3" | "s3a" => {
            let mut b = AmazonS3Builder::from_env()
                .with_http_connector(BoundedConnector)
                .with_url(url.as_str())
                .with_retry(limits.retry());
            for (k, v) in client {
                b = b.with_config(AmazonS3ConfigKey::Client(k), v);
            }
            let s = Arc::new(b.build()?);
            (s.clone(), Some(s))
        }
        "gs" => {
            let mut b = GoogleCloudStorageBuilder::from_env()
                .with_http_connector(BoundedConnector)
                .with_url(url.as_str())
                .with_retry(limits.retry());
            for (k, v) in client {
                b = b.with_config(GoogleConfigKey::Client(k), v);
            }
            let s = Arc::new(b.build()?);
            (s.clone(), Some(s))
        }
        "http" | "https" => {
            let origin = &url[..url::Position::BeforePath];
            let mut b = HttpBuilder::new()
                .with_http_connector(BoundedConnector)
                .with_url(origin)
                .with_retry(limits.retry())
                .with_config(ClientConfigKey::AllowHttp, "true");
            for (k, v) in client {
                b = b.with_config(k, v);
            }
            (Arc::new(b.build()?), None)
        }
        _ => {
            let mut b = MicrosoftAzureBuilder::from_env()
                .with_http_connector(BoundedConnector)
                .with_url(url.as_str())
                .with_retry(limits.retry());
            for (k, v) in client {
                b = b.with_config(AzureConfigKey::Client(k), v);
            }
            let s = Arc::new(b.build()?);
            (s.clone(), Some(s))
        }
    })
}
