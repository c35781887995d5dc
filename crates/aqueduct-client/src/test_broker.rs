//! A broker in this process for the crate's unit tests (the integration tests have their own).
#![cfg(test)]

use std::net::SocketAddr;
use std::path::PathBuf;

/// A broker on 127.0.0.1 port 0 with a development certificate, served until [`stop`].
///
/// [`stop`]: TestBroker::stop
pub(crate) struct TestBroker {
    _dir: tempfile::TempDir,
    pub cert: PathBuf,
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The serving task: stopped with [`stop`](Self::stop), aborted if the broker is dropped
    /// (a test that failed before it stopped it), so it never outlives the test's broker.
    task: Option<tokio::task::JoinHandle<Result<(), aqueduct_server::ServerError>>>,
}

impl Drop for TestBroker {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl TestBroker {
    pub(crate) async fn start() -> TestBroker {
        let dir = tempfile::tempdir().expect("temp dir");
        let cert = dir.path().join("dev-cert.pem");
        let server =
            aqueduct_server::Server::bind(aqueduct_server::Config::for_tests(cert.clone()))
                .await
                .expect("broker binds");
        let addr = server.local_addr();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(server.serve(async move {
            let _ = stopped.await;
        }));
        TestBroker {
            _dir: dir,
            cert,
            addr,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// Options to connect to it, trusting its development certificate.
    pub(crate) fn options(&self) -> crate::ConnectOptions {
        crate::ConnectOptions::new(self.addr.to_string()).dev_cert_file(&self.cert)
    }

    /// Stop it and wait (at most 10 s) until it has.
    pub(crate) async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(mut task) = self.task.take() {
            let limit = std::time::Duration::from_secs(10);
            if tokio::time::timeout(limit, &mut task).await.is_err() {
                task.abort();
            }
        }
    }
}
