//! A broker in this process for the crate's unit tests (the integration tests have their own).

use std::net::SocketAddr;
use std::path::PathBuf;

/// A broker on 127.0.0.1 port 0 with a development certificate, served until [`stop`].
///
/// [`stop`]: TestBroker::stop
pub(crate) struct TestBroker {
    _dir: tempfile::TempDir,
    pub cert: PathBuf,
    pub addr: SocketAddr,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), aqueduct_server::ServerError>>,
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
            stop,
            task,
        }
    }

    /// Options to connect to it, trusting its development certificate.
    pub(crate) fn options(&self) -> crate::ConnectOptions {
        crate::ConnectOptions::new(self.addr.to_string()).dev_cert_file(&self.cert)
    }

    /// Stop it and wait (at most 10 s) until it has.
    pub(crate) async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), self.task).await;
    }
}
